"""pretrained: capture parity with each architecture's own eager attention, on random models
built from configs (no hub access); weight maps; pre/post rotary; bad input."""

import operator

import numpy as np
import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoConfig,
    OlmoeConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
    Starcoder2Config,
    T5Config,
)

from qkgeom.probing import archs as A
from qkgeom.probing import hf as P

SMALL = dict(vocab_size=97)
DECODER = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    **SMALL,
)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # ids inside the small vocabulary
CONFIGS = {
    "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **SMALL),
    "gpt_neox": GPTNeoXConfig(rotary_pct=0.25, **DECODER),
    "llama": LlamaConfig(num_key_value_heads=2, **DECODER),
    "qwen2": Qwen2Config(num_key_value_heads=1, **DECODER),
    "mistral": MistralConfig(num_key_value_heads=2, sliding_window=5, **DECODER),  # a window of 5 of 16 keys
    "bert": BertConfig(**DECODER),
    "qwen3": Qwen3Config(num_key_value_heads=2, head_dim=8, **DECODER),
    "olmo2": Olmo2Config(num_key_value_heads=2, **TOKENS, **DECODER),
    "olmo": OlmoConfig(num_key_value_heads=2, clip_qkv=1.5, **TOKENS, **DECODER),  # q, k clamped to [-1.5, 1.5]
    "olmo3": Olmo3Config(num_key_value_heads=2, sliding_window=5, **TOKENS, **DECODER),
    "olmoe": OlmoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **TOKENS, **DECODER),
    "mixtral": MixtralConfig(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, **TOKENS, **DECODER
    ),
    "qwen2_moe": Qwen2MoeConfig(
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        **TOKENS,
        **DECODER,
    ),
    "qwen3_moe": Qwen3MoeConfig(
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        **TOKENS,
        **DECODER,
    ),
    "starcoder2": Starcoder2Config(num_key_value_heads=2, sliding_window=5, **TOKENS, **DECODER),
    "granite": GraniteConfig(num_key_value_heads=2, attention_multiplier=0.25, **TOKENS, **DECODER),
    "smollm3": SmolLM3Config(num_key_value_heads=2, no_rope_layers=[1, 0], **TOKENS, **DECODER),  # layer 1: NoPE
    # logit softcap, query_pre_attn_scalar; layer 0 slides (window 5), layer 1 sees every earlier key
    "gemma2": Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=5, **DECODER),
    "gemma3_text": Gemma3TextConfig(num_key_value_heads=2, head_dim=8, sliding_window=5, **DECODER),
    "phi3": Phi3Config(num_key_value_heads=2, **TOKENS, **DECODER),
    "opt": OPTConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **SMALL,
    ),
    "gpt_bigcode": GPTBigCodeConfig(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, multi_query=True, bos_token_id=1, eos_token_id=2, **SMALL
    ),
}
KEY_HEADS = {"llama": 2, "qwen2": 1, "mistral": 2, "qwen3": 2, "olmo2": 2, "gemma2": 2, "gemma3_text": 2, "phi3": 2}
KEY_HEADS |= {"olmo": 2, "olmo3": 2, "olmoe": 2, "smollm3": 2, "mixtral": 2, "qwen2_moe": 2, "qwen3_moe": 2}
KEY_HEADS |= {"starcoder2": 2, "granite": 2}
KEY_HEADS["gpt_bigcode"] = 1  # multi-query
# each layer's sliding window
WINDOWED = {"mistral": [5, 5], "gemma2": [5, None], "gemma3_text": [5, 5], "olmo3": [5, 5], "mixtral": [5, 5]}
WINDOWED["starcoder2"] = [5, 5]


def visible(T: int, window: int | None) -> torch.Tensor:
    """The keys each query of a causal layer sees: j <= i, and i - window < j in a sliding-window layer."""
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    return allowed if window is None else allowed.triu(-(window - 1))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def folder(request, tmp_path_factory):
    """A randomly initialised model saved to a local folder, with larger Q/K weights so attention is peaked."""
    name = request.param
    torch.manual_seed(0)
    cls = AutoModel if name == "bert" else AutoModelForCausalLM
    model = cls.from_config(CONFIGS[name])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if any(s in n for s in ("c_attn", "query_key_value", "q_proj", "k_proj", "qkv_proj", "query", "key")):
                if p.dim() == 2:
                    p.mul_(8)
            if "q_norm" in n or "k_norm" in n:  # q/k-norm models: peaked attention needs larger gains
                p.add_(3.0)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return name, path


def ids(batch=3, seq=16):
    return torch.from_numpy(np.random.default_rng(0).integers(0, 97, (batch, seq)))


def test_patterns_equal_the_models_own_eager_attention(folder):
    name, path = folder
    ours = P.load_model(str(path))
    cls = AutoModel if name == "bert" else AutoModelForCausalLM
    eager = cls.from_pretrained(path, attn_implementation="eager").eval()
    x = ids()
    kept = []
    rows, spectra = P.analyse_model(ours, iter([x]), keep=kept)
    with torch.no_grad():
        ref = eager(input_ids=x, output_attentions=True)
        out = ours(input_ids=x)
    assert len(kept) == len(ref.attentions) == 2
    assert [m["window"] for m in kept] == WINDOWED.get(name, [None, None])
    for layer, (mine, theirs) in enumerate(zip(kept, ref.attentions, strict=True)):
        assert mine["layer"] == layer
        # recompute the probabilities from the captured q, k alone
        q, k = mine["q"], mine["k"].repeat_interleave(mine["q"].shape[1] // mine["k"].shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) * mine["scale"]
        if mine["softcap"] is not None:
            scores = torch.tanh(scores / mine["softcap"]) * mine["softcap"]
        if name != "bert":
            scores = scores.masked_fill(~visible(16, mine["window"]), float("-inf"))
        assert torch.allclose(scores.softmax(-1), theirs, atol=1e-5)
        assert theirs.max() > 5 / theirs.shape[-1]  # far from uniform: the test has teeth
    key = "logits" if name != "bert" else "last_hidden_state"
    assert torch.allclose(getattr(out, key), getattr(ref, key), atol=1e-4)
    sites = {r["site"] for r in rows}
    expected = {"pre_rotary", "post_rotary"} if P.ARCHS[name].rotary else {"none"}
    assert sites == expected | ({"norm_folded"} if P.ARCHS[name].qk_norm else set())
    n_kv = KEY_HEADS.get(name, 4)
    key_heads = {r["head"] for r in rows if r["metric"] == "key_participation_ratio" and r["head"] >= 0}
    assert key_heads == set(range(n_kv))
    ent = [r["value"] for r in rows if r["metric"] == "attention_entropy_normalised" and r["head"] >= 0]
    assert all(0 <= v <= 1 for v in ent)


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_logit_statistics_see_the_sliding_window(name):
    """A sliding-window layer's softmax sees the last `window` keys; its logit row std and spectral norm
    are of those scores too (they were of every earlier key, as in a full layer). Checked against numpy on
    the captured q, k: each row's std over the keys it sees, the top singular value of the scores with
    the unseen ones zero, averaged over rows / sequences, at the model's own logit scale."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]).eval()  # analyse_model reads it through its own attention
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ("q_proj" in n or "k_proj" in n) and p.dim() == 2:
                p.mul_(8)
    kept = []
    rows, _ = P.analyse_model(model, iter([ids(3, 16)]), keep=kept)
    got = {(r["layer"], r["head"], r["metric"]): r["value"] for r in rows if r["site"] == "post_rotary"}
    for mine in kept:
        q = mine["q"].double().numpy()
        k = mine["k"].repeat_interleave(4 // mine["k"].shape[1], dim=1).double().numpy()
        seen = visible(16, WINDOWED[name][mine["layer"]]).numpy()  # the config's window, not the code's
        for h in range(4):
            scores = q[:, h] @ k[:, h].transpose(0, 2, 1) * mine["scale"]  # (3 sequences, 16, 16)
            row_std = np.mean([np.std(s[i, seen[i]]) for s in scores for i in range(1, 16)])  # row 0 sees one key
            top = np.mean([np.linalg.svd(np.where(seen, s, 0.0), compute_uv=False)[0] for s in scores])
            layer = mine["layer"]
            assert got[(layer, h, "logit_row_std")] == pytest.approx(row_std, rel=1e-4), (layer, h)
            assert got[(layer, h, "logit_spectral_norm")] == pytest.approx(top, rel=1e-4), (layer, h)
    assert [m["window"] for m in kept] == WINDOWED[name] and 5 in WINDOWED[name]  # a window that cuts: teeth


def test_the_window_is_the_masks():
    """A layer names a sliding window in its attention call; where it is shorter than the keys, the window
    used is the mask's, read once per layer (the mask is what the softmax sees: a model whose call named
    a window its mask does not apply would otherwise get banded logits). No window named, or one at least
    as long as the keys: None, and the device is not read (a meta tensor cannot be)."""
    rec = P._Recorder({}, {})
    causal = torch.arange(1, 17).expand(2, 16)  # keys each query sees under a plain causal mask
    assert P._window(rec, 0, 5, causal, 16) is None and rec.windows == {0: None}  # named, not applied
    assert P._window(rec, 1, 5, causal.clamp(max=5), 16) == 5 and rec.windows[1] == 5
    assert P._window(rec, 1, 5, causal, 16) == 5  # read once per layer
    unreadable = torch.empty(2, 16, device="meta")
    assert P._window(rec, 2, None, unreadable, 16) is None and P._window(rec, 2, 16, unreadable, 16) is None
    assert 2 not in rec.windows


@torch.no_grad()
def _projections(name: str, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of x (5, 32) through the model's own projection modules, biases removed."""
    if name == "gpt2":
        return attn.c_attn(x)[:, :32] - attn.c_attn.bias[:32], attn.c_attn(x)[:, 32:64] - attn.c_attn.bias[32:64]
    if name == "gpt_neox":
        out = (attn.query_key_value(x) - attn.query_key_value.bias).view(5, 4, 3, 8)
        return out[:, :, 0].reshape(5, 32), out[:, :, 1].reshape(5, 32)
    if name == "bert":
        return attn.query(x) - attn.query.bias, attn.key(x) - attn.key.bias
    if name == "phi3":
        return attn.qkv_proj(x)[:, :32], attn.qkv_proj(x)[:, 32:48]
    if name == "gpt_bigcode":
        out = attn.c_attn(x) - attn.c_attn.bias
        return out[:, :32], out[:, 32:40]
    q = attn.q_proj(x) - (attn.q_proj.bias if attn.q_proj.bias is not None else 0)
    return q, attn.k_proj(x) - (attn.k_proj.bias if attn.k_proj.bias is not None else 0)


def test_weight_maps_reproduce_the_projections(folder):
    name, path = folder
    model = P.load_model(str(path))
    w_q, w_k = P.arch_of(model).weights(model)
    x = torch.randn(5, 32)
    kept = []
    P.analyse_model(model, iter([ids(1, 8)]), keep=kept)
    attn = A._attn_modules(model, P.ARCHS[name].marker)[0]
    q, k = _projections(name, attn, x)
    _check_value_output(name, model, attn, x)
    for h in range(w_q[0].shape[0]):
        assert torch.allclose(x @ w_q[0][h], q[:, h * 8 : (h + 1) * 8], atol=1e-5)
    for h in range(w_k[0].shape[0]):
        assert torch.allclose(x @ w_k[0][h], k[:, h * 8 : (h + 1) * 8], atol=1e-5)
    if name == "gpt_neox":  # partial rotary (25% of 8 dims = 2): only the first two dims rotate
        first = kept[0]
        assert torch.allclose(first["q"][..., 2:], first["pre_q"][..., 2:])
        assert not torch.allclose(first["q"][..., :2], first["pre_q"][..., :2])
    if P.ARCHS[name].rotary and name != "gpt_neox":
        # position 0 is rotated by 0: the pre-rotary site must equal what enters the rotary, i.e. the
        # *normalised* q/k in q/k-norm models (the raw projection would differ)
        first = kept[0]
        assert torch.allclose(first["q"][:, :, 0], first["pre_q"][:, :, 0], atol=1e-6)
        assert torch.allclose(first["k"][:, :, 0], first["pre_k"][:, :, 0], atol=1e-6)
        assert not torch.allclose(first["q"][:, :, 1:], first["pre_q"][:, :, 1:])
    if P.ARCHS[name].qk_norm:  # weight metrics raw and with the norm gains folded in (all gains are 4 here)
        rows, _ = P.analyse_model(model, iter([ids(1, 8)]))
        raw = {(r["layer"], r["head"], r["metric"]): r["value"] for r in rows if r["site"] == "pre_rotary"}
        folded = {(r["layer"], r["head"], r["metric"]): r["value"] for r in rows if r["site"] == "norm_folded"}
        key = (0, 0, "interaction_spectral_norm")
        assert folded[key] == pytest.approx(16 * raw[key], rel=1e-5)  # gains 4 x 4, uniform: spectrum x 16
        assert folded[(0, 0, "interaction_rank")] == pytest.approx(raw[(0, 0, "interaction_rank")], rel=1e-6)


def _check_value_output(name, model, attn, x):
    """W_V^h reproduces the value projection of head h; the W_O^h reassemble the output projection:
    out(z) = sum_h z_h (W_O^h)^T for any z (bias removed)."""
    w_v, w_o = P.arch_of(model).value_output(model)
    with torch.no_grad():
        if name == "gpt2":
            v = attn.c_attn(x)[:, 64:96] - attn.c_attn.bias[64:96]
        elif name == "gpt_neox":
            v = (attn.query_key_value(x) - attn.query_key_value.bias).view(5, 4, 3, 8)[:, :, 2].reshape(5, 32)
        elif name == "bert":
            v = attn.value(x) - attn.value.bias
        elif name == "phi3":
            v = attn.qkv_proj(x)[:, 48:64]
        elif name == "gpt_bigcode":
            v = (attn.c_attn(x) - attn.c_attn.bias)[:, 40:48]
        else:
            v = attn.v_proj(x) - (attn.v_proj.bias if attn.v_proj.bias is not None else 0)
    for h in range(w_v[0].shape[0]):
        assert torch.allclose(x @ w_v[0][h], v[:, h * 8 : (h + 1) * 8], atol=1e-5)
    if name == "bert":
        assert w_o is None  # BERT's output projection sits outside its self-attention module
        return
    out = {"gpt2": "c_proj", "gpt_neox": "dense", "gpt_bigcode": "c_proj", "opt": "out_proj"}.get(name, "o_proj")
    proj = getattr(attn, out)
    z = torch.randn(5, 32)
    with torch.no_grad():
        want = proj(z) - (proj.bias if getattr(proj, "bias", None) is not None else 0)
    got = sum(z[:, h * 8 : (h + 1) * 8] @ w_o[0][h].T for h in range(4))
    assert torch.allclose(got, want, atol=1e-5)


def test_streaming_is_batch_invariant_for_pr(folder):
    _, path = folder
    model = P.load_model(str(path))
    tokens = np.random.default_rng(1).integers(0, 97, 4 * 16)
    one = {
        (r["site"], r["layer"], r["head"], r["metric"]): r["value"]
        for r in P.analyse_model(model, P.token_batches(tokens, 16, 4, 64))[0]
    }
    four = {
        (r["site"], r["layer"], r["head"], r["metric"]): r["value"]
        for r in P.analyse_model(model, P.token_batches(tokens, 16, 1, 64))[0]
    }
    for key, v in one.items():
        if "participation_ratio" in key[3] and "logit" not in key[3]:
            assert four[key] == pytest.approx(v, rel=1e-5, abs=1e-5), key  # float32 batch Gram matrices


def test_the_batch_bar_has_a_total_and_an_eta(folder, capsys):
    """`qkgeom pretrained MODEL` (one revision) drew "batches: 3batch [00:41, 13.7s/batch]": no total, so no
    ETA on a model that takes minutes. token_batches says how many batches are left (length_hint), and
    the bar reads it; the batches themselves are those of consecutive text, as before."""
    _, path = folder
    model = P.load_model(str(path))
    batches = P.token_batches(np.arange(1000) % 97, seq_len=16, batch_size=2, n_tokens=200)  # 200 // 32 = 6
    assert operator.length_hint(batches) == 6
    first = next(batches)
    assert operator.length_hint(batches) == 5 and first.tolist() == [list(range(16)), list(range(16, 32))]
    P.analyse_model(model, batches, progress=True)
    assert operator.length_hint(batches) == 0
    bar = capsys.readouterr().err
    assert "batches: 100%" in bar and "5/5" in bar, bar  # the five left


def test_bad_input(tmp_path):
    T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=16, vocab_size=20).save_pretrained(tmp_path / "t5")
    with pytest.raises(P.PretrainedError, match="unsupported model type 't5'; supported: bert, gemma2, .*archs.py"):
        P.load_model(str(tmp_path / "t5"))
    CONFIGS["gpt2"].save_pretrained(tmp_path / "g")
    with pytest.raises(P.PretrainedError, match=r"needs about .* GiB .* only 0.0 GiB available"):
        P.load_model(str(tmp_path / "g"), memory_limit=1000)
    with pytest.raises(P.PretrainedError, match="fewer than one batch"):
        next(P.token_batches(np.arange(100), 64, 2, 10_000))
    with pytest.raises(P.PretrainedError, match="--n-tokens 100 is less than one batch .* at least 128"):
        next(P.token_batches(np.arange(10_000), 64, 2, 100))  # the text is ample: blame --n-tokens
    with pytest.raises(P.PretrainedError, match="--n-tokens 100 is less than one batch"):
        next(P.token_batches(np.arange(80), 64, 2, 100))  # text read only as far as n_tokens needs: still --n-tokens
    with pytest.raises(P.PretrainedError, match="no model folder at .*missing-model-folder"):
        P.load_model(str(tmp_path / "missing-model-folder"))  # a path, so no hub name: refused before the hub


@pytest.mark.parametrize(
    "folder, message",
    [("t5", "supported: bert"), ("no/such/model", "no model folder at")],  # the second: a path naming nothing
)
def test_unsupported_or_missing_local_model_is_refused_before_torch_is_imported(tmp_path, folder, message):
    # the refusal must not wait for torch / transformers (seconds): checked structurally, not timed
    import subprocess
    import sys

    if folder == "t5":
        (tmp_path / "t5").mkdir()
        (tmp_path / "t5" / "config.json").write_text('{"model_type": "t5"}')
    code = (
        "import sys; from qkgeom.cli import main; rc = main(['pretrained', sys.argv[1]]); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / folder)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert folder != "t5" or "qkgeom/probing/archs.py" in r.stderr


def test_a_hub_shaped_name_is_left_to_the_hub():
    """Only a name that cannot be a repo id is refused locally; 'name' and 'org/name' go to the hub (none
    of these exists on disk here)."""
    from qkgeom.probing.archs import check_model_type

    for name in ("gpt2", "EleutherAI/pythia-70m", "HuggingFaceTB/SmolLM2-135M", "org/name.v1"):
        check_model_type(name)
    for name in ("/no/such/model", "./nosuch", "runs/hf/mine", "x/", "a--b/c d"):
        with pytest.raises(P.PretrainedError, match="no model folder at"):
            check_model_type(name)


def test_a_hub_out_of_reach_says_what_to_do(tmp_path, monkeypatch):
    """Offline, a hub name not in the cache ended in transformers' "couldn't connect" line, after 31 s of
    the hub's retries where HF_HUB_OFFLINE was unset: the line now says what to do in each case. Run for
    real with HF_HUB_OFFLINE=1 and an empty HF_HOME (no network touched); the same transformers line read
    without the setting names it."""
    import os
    import subprocess
    import sys

    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-m", "qkgeom.cli", "pretrained", "gpt2", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "couldn't connect" in r.stderr and "(HF_HUB_OFFLINE is set: download it where" in r.stderr
    first = r.stderr.split("revision main: ", 1)[1].split(" (HF_HUB_OFFLINE", 1)[0]  # transformers' own words
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    line = str(P._load_error("gpt2", None, OSError(first + ".\nCheck your connection")))
    assert line.endswith(
        "(no network? HF_HUB_OFFLINE=1 reads the Hugging Face cache at once, without the hub's retries)"
    )
    assert str(P._load_error("gpt2", None, OSError("gpt2 is not a valid model."))).endswith("not a valid model.")


def _bos_tokenizer(folder):
    """A real fast tokenizer saved locally that opens every sequence with <s>, as Llama-family ones do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "a": 2, "b": 3, "c": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder


def test_sequences_open_with_the_models_own_start_tokens(tmp_path):
    folder = _bos_tokenizer(tmp_path / "tok")
    ids, prefix = P.text_tokens(str(folder), "a b c a b c")
    assert list(ids) == [2, 3, 4, 2, 3, 4] and prefix == (1,)
    assert P.text_tokens(str(folder), "a b c", special_tokens=False)[1] == ()
    batches = list(P.token_batches(np.arange(10, 40), seq_len=5, batch_size=2, n_tokens=16, prefix=prefix))
    assert len(batches) == 2 and batches[0].tolist() == [[1, 10, 11, 12, 13], [1, 14, 15, 16, 17]]
    assert batches[1][:, 0].tolist() == [1, 1] and batches[1][0, 1] == 18  # text continues, BOS repeats
    assert next(P.token_batches(np.arange(10, 40), 5, 2, 16))[0].tolist() == [10, 11, 12, 13, 14]  # stripped


def test_tokenizing_running_text_warns_nothing(tmp_path, caplog):
    """text_tokens tokenizes a whole text that is then cut into sequences: transformers' warning that it is
    "longer than the specified maximum sequence length" (here 8) would be false, and is not printed."""
    from transformers import AutoTokenizer

    folder = _bos_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.model_max_length = 8
    tok.save_pretrained(folder)
    caplog.clear()  # transformers' records reach pytest's log capture (its own handler's stream may not be fd 2)
    ids, start = P.text_tokens(str(folder), "a b c " * 10)
    assert len(ids) == 30 and start == (1,)
    assert "maximum sequence length" not in caplog.text


def test_loading_draws_no_bar_of_its_own(tmp_path, capfd):
    """A family loads one model per revision: transformers' per-load "Loading weights" bar would print 22
    bars under the caller's; the loader silences it and leaves the caller's setting as it found it."""
    from transformers.utils import logging as hf_logging

    AutoModelForCausalLM.from_config(CONFIGS["gpt2"]).save_pretrained(tmp_path / "g")
    before = hf_logging.is_progress_bar_enabled()  # an earlier test in this process (`qkgeom pretrained`) may
    hf_logging.enable_progress_bar()  # have turned the bars off for good: on here, as a user's would be
    try:
        capfd.readouterr()
        P.load_model(str(tmp_path / "g"))
        assert "Loading weights" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled()
    finally:
        if not before:
            hf_logging.disable_progress_bar()
