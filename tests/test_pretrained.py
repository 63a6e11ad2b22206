"""pretrained: capture parity with each architecture's own eager attention, on random models
built from configs (no hub access); weight maps; pre/post rotary; bad input."""

import numpy as np
import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    T5Config,
)

from qkgeom import pretrained as P

SMALL = dict(vocab_size=97)
DECODER = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    **SMALL,
)
CONFIGS = {
    "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **SMALL),
    "gpt_neox": GPTNeoXConfig(rotary_pct=0.25, **DECODER),
    "llama": LlamaConfig(num_key_value_heads=2, **DECODER),
    "qwen2": Qwen2Config(num_key_value_heads=1, **DECODER),
    "mistral": MistralConfig(num_key_value_heads=2, sliding_window=None, **DECODER),
    "bert": BertConfig(**DECODER),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def folder(request, tmp_path_factory):
    """A randomly initialised model saved to a local folder, with larger Q/K weights so attention is peaked."""
    name = request.param
    torch.manual_seed(0)
    cls = AutoModel if name == "bert" else AutoModelForCausalLM
    model = cls.from_config(CONFIGS[name])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if any(s in n for s in ("c_attn", "query_key_value", "q_proj", "k_proj", "query", "key")) and p.dim() == 2:
                p.mul_(8)
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
    P.RECORDER.keep = []
    try:
        rows, spectra = P.analyse_model(ours, iter([x]))
        kept = P.RECORDER.keep
    finally:
        P.RECORDER.keep = None
    with torch.no_grad():
        ref = eager(input_ids=x, output_attentions=True)
        out = ours(input_ids=x)
    assert len(kept) == len(ref.attentions) == 2
    for layer, (mine, theirs) in enumerate(zip(kept, ref.attentions, strict=True)):
        assert mine["layer"] == layer
        # recompute the probabilities from the captured q, k alone
        q, k = mine["q"], mine["k"].repeat_interleave(mine["q"].shape[1] // mine["k"].shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if name != "bert":
            scores = scores.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
        assert torch.allclose(scores.softmax(-1), theirs, atol=1e-5)
        assert theirs.max() > 5 / theirs.shape[-1]  # far from uniform: the test has teeth
    key = "logits" if name != "bert" else "last_hidden_state"
    assert torch.allclose(getattr(out, key), getattr(ref, key), atol=1e-4)
    sites = {r["site"] for r in rows}
    assert sites == ({"pre_rotary", "post_rotary"} if P.ARCHS[name].rotary else {"none"})
    n_kv = CONFIGS[name].to_dict().get("num_key_value_heads") or 4
    key_heads = {r["head"] for r in rows if r["metric"] == "key_participation_ratio" and r["head"] >= 0}
    assert key_heads == set(range(n_kv))
    ent = [r["value"] for r in rows if r["metric"] == "attention_entropy_normalised" and r["head"] >= 0]
    assert all(0 <= v <= 1 for v in ent)


def test_weight_maps_reproduce_the_projections(folder):
    name, path = folder
    model = P.load_model(str(path))
    w_q, w_k = P.arch_of(model).weights(model)
    x = torch.randn(5, 32)
    P.RECORDER.keep = []
    try:
        P.analyse_model(model, iter([ids(1, 8)]))
        kept = P.RECORDER.keep
    finally:
        P.RECORDER.keep = None
    attn = P._attn_modules(model, P.ARCHS[name].proj)[0]
    with torch.no_grad():
        if name == "gpt2":
            q = attn.c_attn(x)[:, :32] - attn.c_attn.bias[:32]
            k = attn.c_attn(x)[:, 32:64] - attn.c_attn.bias[32:64]
        elif name == "gpt_neox":
            out = (attn.query_key_value(x) - attn.query_key_value.bias).view(5, 4, 3, 8)
            q, k = out[:, :, 0].reshape(5, 32), out[:, :, 1].reshape(5, 32)
        elif name == "bert":
            q, k = attn.query(x) - attn.query.bias, attn.key(x) - attn.key.bias
        else:
            q = attn.q_proj(x) - (attn.q_proj.bias if attn.q_proj.bias is not None else 0)
            k = attn.k_proj(x) - (attn.k_proj.bias if attn.k_proj.bias is not None else 0)
    for h in range(w_q[0].shape[0]):
        assert torch.allclose(x @ w_q[0][h], q[:, h * 8 : (h + 1) * 8], atol=1e-5)
    for h in range(w_k[0].shape[0]):
        assert torch.allclose(x @ w_k[0][h], k[:, h * 8 : (h + 1) * 8], atol=1e-5)
    if name == "gpt_neox":  # partial rotary (25% of 8 dims = 2): only the first two dims rotate
        first = kept[0]
        assert torch.allclose(first["q"][..., 2:], first["pre_q"][..., 2:])
        assert not torch.allclose(first["q"][..., :2], first["pre_q"][..., :2])
    if name == "llama":
        first = kept[0]
        assert torch.allclose(first["q"][:, :, 0], first["pre_q"][:, :, 0])  # position 0: rotation by 0
        assert not torch.allclose(first["q"][:, :, 1:], first["pre_q"][:, :, 1:])


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


def test_bad_input(tmp_path):
    T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=16, vocab_size=20).save_pretrained(tmp_path / "t5")
    with pytest.raises(P.PretrainedError, match="unsupported model type 't5'; supported: bert, gpt2, gpt_neox"):
        P.load_model(str(tmp_path / "t5"))
    CONFIGS["gpt2"].save_pretrained(tmp_path / "g")
    with pytest.raises(P.PretrainedError, match=r"needs about .* GiB .* only 0.0 GiB available"):
        P.load_model(str(tmp_path / "g"), memory_limit=1000)
    with pytest.raises(P.PretrainedError, match="fewer than one batch"):
        next(P.token_batches(np.arange(100), 64, 2, 10_000))
    with pytest.raises(P.PretrainedError, match="cannot load"):
        P.load_model(str(tmp_path / "missing-model-folder"))
