"""Hugging Face models -> QKSnapshot rows: token-level Q/K geometry of pretrained checkpoints.

Capture is architecture-agnostic: transformers routes every attention module through an
"attention interface" with the post-rotary q (B, H_q, T, E), k (B, H_kv, T, E), the scaling
and the mask. We register one more implementation, ``qkgeom``, that computes eager softmax
attention explicitly and streams each layer's q, k and pattern into a GeometryAccumulator, so
nothing is cached across layers or batches. Pre-rotary q/k (GPT-NeoX, Llama family) come from
forward hooks on the projections. Weight-side spectra use per-architecture W_Q^h, W_K^h maps.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from torch import nn

from qkgeom import device as D
from qkgeom.config import DEFAULT_PROBE, ProbeSettings
from qkgeom.probing.archs import (
    ADD_ARCH_HINT,
    ARCHS,
    Arch,
    PretrainedError,
    arch_of,
    check_model_type,
    context_length,
    resolve_revision,
)
from qkgeom.probing.probe import GeometryAccumulator, nonfinite_weights, weight_geometry

Tensor = torch.Tensor
ATTN_IMPL = "qkgeom"


@dataclass
class _Recorder:
    """Receives every attention call of one forward pass (see `qkgeom_attention`)."""

    active: dict[str, GeometryAccumulator]
    pre: dict[int, dict[str, Tensor]]  # pre-rotary q/k per layer, filled by the projection / norm hooks
    keep: list[dict[str, Tensor]] | None = None  # if a list: every call's tensors (tests)
    order: dict[int, int] = field(default_factory=dict)  # id(module) -> layer index, in call order
    windows: dict[int, int | None] = field(default_factory=dict)  # layer -> the sliding window its mask holds


# The attention function is registered with transformers by name, so it reaches the recorder of
# the forward pass in progress through this context variable; `recording` sets it for a block and
# always resets it, as the hooks module's context managers do with hooks.
_ACTIVE: ContextVar[_Recorder | None] = ContextVar("qkgeom_recorder", default=None)


@contextmanager
def recording(model: nn.Module, accs: dict[str, GeometryAccumulator], keep: list | None = None) -> Iterator[None]:
    """During the block, every attention call of `model` streams into `accs` (and `keep`)."""
    rec = _Recorder(accs, {}, keep)
    handles = arch_of(model).pre_rotary_hooks(model, rec.pre)
    token = _ACTIVE.set(rec)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        for h in handles:
            h.remove()


def _window(rec: _Recorder, layer: int, named: int | None, support: Tensor, keys: int) -> int | None:
    """The sliding window of a causal layer's mask, for its logit statistics: a sliding-window layer (the
    README's table says which) names one in its attention call; where it is shorter than the keys, the
    mask is read for it once per layer (the mask decides, as it does for the softmax: a config may name a
    window its mask does not apply). No window named, or one that cuts nothing: None, and no read of the
    device."""
    if named is None or named >= keys:
        return None
    if layer not in rec.windows:
        seen = int(D.host_float(support.max()))  # the most keys any query of the batch sees
        rec.windows[layer] = seen if seen < keys else None
    return rec.windows[layer]


def qkgeom_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs
):  # fmt: skip
    """Eager attention that also streams q, k and the pattern of this layer into the recorder.
    `softcap` (Gemma 2): scores -> softcap * tanh(scores / softcap) before the mask, as the model does."""
    B, H, T, E = query.shape
    groups = H // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else E**-0.5
    scores = query @ k.transpose(-1, -2) * scale  # (B, H, T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    S = k.shape[-2]
    if attention_mask is not None:  # eager-style additive float mask (or boolean), (B, 1, T, S)
        mask = attention_mask[..., :S]
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        scores = scores.masked_fill(~allowed, float("-inf")) if mask.dtype == torch.bool else scores + mask
    elif getattr(module, "is_causal", False) and T > 1:
        allowed = torch.ones(1, 1, T, S, dtype=torch.bool, device=query.device).tril(S - T)
        scores = scores.masked_fill(~allowed, float("-inf"))
    else:
        allowed = torch.ones(1, 1, T, S, dtype=torch.bool, device=query.device)
    pattern = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    rec = _ACTIVE.get()
    if rec is not None:
        layer = rec.order.setdefault(id(module), len(rec.order))
        support = allowed.expand(B, -1, T, S)[:, 0].sum(-1)  # (B, T) keys visible to each query
        causal = bool(getattr(module, "is_causal", False))
        window = _window(rec, layer, kwargs.get("sliding_window") if causal else None, support, S)
        pre = rec.pre.pop(layer) if "post_rotary" in rec.active else None
        # the logit spectrum is of the scores the model uses: q k^T * scale (e.g. Gemma's
        # query_pre_attn_scalar, OPT's pre-scaled q with scale 1), not always q k^T / sqrt(E)
        logit_scale = scale * E**0.5
        if pre is not None:
            post, pre_acc = rec.active["post_rotary"], rec.active["pre_rotary"]
            post.update_layer(layer, query, key, pattern, support, causal, logit_scale=logit_scale, window=window)
            pre_acc.update_layer(layer, pre["q"], pre["k"], None, support, causal, window=window)
        else:
            rec.active["none"].update_layer(
                layer, query, key, pattern, support, causal, logit_scale=logit_scale, window=window
            )
        if rec.keep is not None:
            rec.keep.append(
                {
                    "layer": layer,
                    "q": query.detach(),
                    "k": key.detach(),
                    "pattern": pattern.detach(),
                    "scale": scale,
                    "softcap": softcap,
                    "window": window,
                    **({"pre_q": pre["q"], "pre_k": pre["k"]} if "post_rotary" in rec.active else {}),
                }
            )
    out = pattern @ v  # (B, H, T, E)
    return out.transpose(1, 2).contiguous(), pattern


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPL, qkgeom_attention)
    AttentionMaskInterface.register(ATTN_IMPL, eager_mask)


def available_memory() -> int:
    """Bytes of memory available (MemAvailable), or a large number where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def estimate_bytes(config) -> int:
    """float32 weights of a model built from `config` on the meta device (no memory used)."""
    from transformers import AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return 4 * sum(p.numel() for p in model.parameters())


def _load_error(name: str, revision: str | None, e: Exception) -> PretrainedError:
    """One line: transformers' first line, and what to do where the hub was out of reach."""
    from huggingface_hub import constants

    first = str(e).strip().splitlines()[0]
    if "couldn't connect" in first:  # transformers' words when the hub is out of reach and no cache has the files
        first = first.rstrip(".") + (
            " (HF_HUB_OFFLINE is set: download it where the hub is reachable, into the same HF_HOME, or give a folder)"
            if constants.HF_HUB_OFFLINE
            else " (no network? HF_HUB_OFFLINE=1 reads the Hugging Face cache at once, without the hub's retries)"
        )
    return PretrainedError(f"cannot load {name!r} at revision {revision or 'main'}: {first}")


@contextmanager
def hf_quiet() -> Iterator[None]:
    """transformers' reports and progress bars off for one load or save, the caller's settings restored after:
    a checkpoint family loads (and exports) one model per revision, and a bar for each drowns the caller's."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_model(name: str, revision: str | None = None, memory_limit: int | None = None) -> nn.Module:
    """A Hugging Face model by hub name (+ revision, cached by transformers) or local folder, in float32,
    routed through the qkgeom attention. Fails before loading if it cannot fit in memory."""
    check_model_type(name, revision)  # a local unsupported model or folder: refused before transformers is imported
    name, revision = resolve_revision(name, revision)
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    _register()
    try:
        config = AutoConfig.from_pretrained(name, revision=revision)
    except Exception as e:  # noqa: BLE001 - parsing the user's config.json: its validators raise several types
        raise _load_error(name, revision, e) from None
    if config.model_type not in ARCHS:
        raise PretrainedError(
            f"unsupported model type {config.model_type!r}; supported: {', '.join(sorted(ARCHS))}; {ADD_ARCH_HINT}"
        )
    try:  # builds the model on the meta device: its constructor checks the shapes (heads dividing the width)
        need = int(1.3 * estimate_bytes(config))
    except (ValueError, TypeError, AssertionError) as e:
        raise _load_error(name, revision, e) from None
    have = memory_limit or available_memory()
    if need > have:
        raise PretrainedError(
            f"{name} needs about {need / 2**30:.1f} GiB (float32 weights + 30%), only {have / 2**30:.1f} GiB available"
        )
    cls = AutoModel if config.model_type == "bert" else AutoModelForCausalLM
    try:
        with hf_quiet():  # its load report would repeat, unasked, what check_loading_info refuses
            model, info = cls.from_pretrained(
                name,
                revision=revision,
                attn_implementation=ATTN_IMPL,
                dtype=torch.float32,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported in `info` and refused by check_loading_info, by name
            )
    except (OSError, ValueError) as e:
        raise _load_error(name, revision, e) from None
    except SafetensorError as e:  # a truncated or corrupt model.safetensors
        raise PretrainedError(f"the weights of {name} are truncated or corrupt (safetensors: {e})") from None
    except pickle.UnpicklingError:  # torch's weights-only loader refused a pickle that holds more than tensors
        raise PretrainedError(
            f"the weights of {name} are a pickle holding more than tensors; torch refuses to unpickle it (it could "
            "run code): convert it to safetensors where you trust its source"
        ) from None
    check_loading_info(name, info)
    return model.eval()


# Weights a checkpoint may lack or carry beyond the model we build without changing what we measure:
# task heads (we read the body), tied output embeddings, and buffers older checkpoints saved. The
# buffers are matched as whole names: GPT-2's causal-mask buffer `h.N.attn.bias` is harmless, its
# Q/K/V bias `h.N.attn.c_attn.bias` is a weight (a missing one would be measured as zero).
_HARMLESS = re.compile(
    r"^(lm_head|cls\.|pooler|.*\.pooler\.|score|classifier|qa_outputs)|(^|\.)(inv_freq|masked_bias|attn\.bias)$"
)


def check_loading_info(name: str, info: dict) -> None:
    """Refuse weights that do not match the config: a missing tensor would be measured at its random
    initialisation, an unexpected one (a layer the config does not have) silently dropped."""
    missing = sorted(k for k in info.get("missing_keys", ()) if not _HARMLESS.search(k))
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not _HARMLESS.search(k))
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ()))
    if missing or unexpected or mismatched:
        parts = [
            f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
            for what, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", mismatched))
            if keys
        ]
        raise PretrainedError(
            f"the weights of {name} do not match its config.json: {'; '.join(parts)} tensors; "
            "measuring it would read randomly initialised weights (fix config.json or the weight files)"
        )


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter and buffer's name, shape, dtype and bytes (duplicate detection)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(D.to_host(t.contiguous().view(torch.uint8)).tobytes())
    return h.hexdigest()


class CountedBatches(Iterator[Tensor]):
    """An iterator of batches that says how many are left (operator.length_hint: a progress bar's total)."""

    def __init__(self, batches: Iterator[Tensor], n: int) -> None:
        self._batches, self._left = batches, n

    def __next__(self) -> Tensor:
        batch = next(self._batches)
        self._left -= 1
        return batch

    def __length_hint__(self) -> int:
        return self._left


def token_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_tokens: int, prefix: tuple[int, ...] = ()
) -> CountedBatches:
    """Consecutive non-overlapping (batch_size, seq_len) batches covering n_tokens tokens; each
    sequence starts with `prefix` (the model's own start tokens, e.g. BOS) followed by text. Too little
    text for one batch is refused here, before any batch is drawn."""
    body = seq_len - len(prefix)
    per_batch = body * batch_size
    n_batches = min(n_tokens, len(tokens)) // per_batch if body > 0 else 0
    if n_batches == 0 and n_tokens < per_batch:  # the text was read only as far as n_tokens needs
        raise PretrainedError(
            f"--n-tokens {n_tokens} is less than one batch of text ({batch_size} x {body} = {per_batch} tokens); "
            f"raise --n-tokens to at least {per_batch}, or lower --batch-size or --seq-len"
        )
    if n_batches == 0:
        raise PretrainedError(
            f"the text has {len(tokens)} tokens, fewer than one batch "
            f"({batch_size} x {seq_len} = {seq_len * batch_size}); lower --batch-size or --seq-len"
        )
    start = np.broadcast_to(np.asarray(prefix, dtype=np.int64), (batch_size, len(prefix)))
    chunks = (
        np.asarray(tokens[b * per_batch : (b + 1) * per_batch], dtype=np.int64).reshape(batch_size, body)
        for b in range(n_batches)
    )
    return CountedBatches((torch.from_numpy(np.concatenate([start, c], axis=1)) for c in chunks), n_batches)


@torch.no_grad()
@D.exact_float32()
def analyse_model(
    model: nn.Module,
    batches: Iterator[Tensor],
    progress: bool = False,
    settings: ProbeSettings = DEFAULT_PROBE,
    keep: list | None = None,
) -> tuple[list[dict], dict]:
    """Stream batches through `model`; rows (layer, head, site, metric, value) and spectra.

    Every token enters the covariances and entropies; the logit-spectrum summary (T x T SVDs,
    the costly part) uses the first `settings.logit_seqs` sequences (None: all). Each batch's centered
    Gram matrix is formed in `settings.gram_dtype`; means, merges and the running state stay float64.
    PRs and alphas under `settings.conventions` (every such row's note names its own).
    `keep`: a list to receive every attention call's q, k, pattern (and pre-rotary q, k) — for tests."""
    from tqdm.auto import tqdm

    arch = arch_of(model)
    D.check_float64(next(model.parameters()).device, "the model")
    bad = nonfinite_weights(model)
    if bad is not None:
        raise PretrainedError(f"the model's weights are not finite ({bad}): there is no geometry to measure")
    if model.config._attn_implementation != ATTN_IMPL:
        _register()
        model.set_attn_implementation(ATTN_IMPL)
    if arch.rotary:
        accs = {
            "post_rotary": GeometryAccumulator(True, "post_rotary", settings),
            "pre_rotary": GeometryAccumulator(False, "pre_rotary", settings),
        }
    else:
        accs = {"none": GeometryAccumulator(True, "none", settings)}
    body = getattr(model, "base_model", model)  # the LM head's logits are not needed: skip them
    device = next(model.parameters()).device  # batches come from the host; the model may be on a GPU
    with recording(model, accs, keep):
        total = operator.length_hint(batches) or None  # token_batches' count, a list's: the bar's ETA
        ids = _input_ids(batches, model, arch)
        for idx in tqdm(ids, total=total, disable=not progress, desc="batches", unit="batch"):
            body(input_ids=idx.to(device))
    rows = [r for acc in accs.values() for r in acc.rows()]
    w_q, w_k = arch.weights(model)
    w_v, w_o = arch.value_output(model)
    w_rows, w_spectra = weight_geometry(
        w_q, w_k, site="pre_rotary" if arch.rotary else "none", w_v=w_v, w_o=w_o, conventions=settings.conventions
    )
    gains = arch.gains(model)
    if gains is not None:  # q/k-norm models: the same metrics with the norm gains folded into W_Q, W_K
        folded_q = [w * g[:, None, :] for w, g in zip(w_q, gains[0], strict=True)]
        folded_k = [w * g[:, None, :] for w, g in zip(w_k, gains[1], strict=True)]
        f_rows, f_spectra = weight_geometry(folded_q, folded_k, site="norm_folded", conventions=settings.conventions)
        w_rows += f_rows
        w_spectra |= {f"norm_folded_{k}": v for k, v in f_spectra.items()}
    spectra = {
        (k if site == "none" else f"{site}_{k}"): v for site, acc in accs.items() for k, v in acc.spectra().items()
    }
    spectra |= w_spectra
    return rows + w_rows, spectra


def ids_problem(idx: object, dims: tuple[int, ...] = (2,)) -> str | None:
    """What keeps `idx` from being a batch of token ids (a non-empty integer tensor of one of `dims`
    dimensions), as "<dtype> <shape>"; None where nothing does."""
    if not isinstance(idx, Tensor):
        return type(idx).__name__
    integer = not (idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool)
    return None if integer and idx.dim() in dims and idx.numel() else f"{idx.dtype} {tuple(idx.shape)}"


def _input_ids(batches: Iterator[Tensor], model: nn.Module, arch: Arch) -> Iterator[Tensor]:
    """Each batch checked before the model sees it (an embedding lookup would fail deep inside it): integer
    ids (B, T) or (T,), within the context of a model with learned positions and, where the batch is on
    the host (no device sync), within the vocabulary. At least one batch."""
    n_vocab = model.get_input_embeddings().num_embeddings
    context = context_length(model)
    i = -1
    for i, idx in enumerate(batches):
        if (why := ids_problem(idx, dims=(1, 2))) is not None:
            raise PretrainedError(f"batch {i}: token ids must be a non-empty integer tensor (B, T), got {why}")
        if not arch.rotary and context and idx.shape[-1] > context:
            raise PretrainedError(f"batch {i}: sequences of {idx.shape[-1]} tokens, beyond the model's {context} "
                                  "positions")  # fmt: skip
        lo, hi = D.host_list(torch.stack([idx.min(), idx.max()])) if idx.device.type == "cpu" else (0, 0)
        if not 0 <= lo <= hi < n_vocab:
            raise PretrainedError(f"batch {i}: token ids outside the model's {n_vocab}-entry vocabulary ({lo} to {hi})")
        yield idx
    if i < 0:
        raise PretrainedError("no batches: analyse needs at least one batch of token ids")


def text_tokens(
    name: str, text: str, tokenizer: str | None = None, revision: str | None = None, special_tokens: bool = True
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Token ids of `text` with the model's own tokenizer (or the one named), and the start tokens
    the tokenizer puts before every sequence (BOS, CLS; none for GPT-2), or () if `special_tokens`
    is False. End tokens (EOS, SEP) are not added: sequences are cut from running text."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer or name, revision=None if tokenizer else revision)
    except (OSError, ValueError) as e:
        raise PretrainedError(
            f"no tokenizer for {tokenizer or name!r} ({str(e).splitlines()[0]}); pass --tokenizer NAME_OR_FOLDER"
        ) from None
    with hf_quiet():  # its "longer than the maximum sequence length" warning is false here: the ids are cut up
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    if len(ids) == 0 and text.strip():  # e.g. a model folder without tokenizer files loads an empty tokenizer
        raise PretrainedError(
            f"the tokenizer of {tokenizer or name!r} turns the text into 0 tokens (a folder without tokenizer "
            "files?); pass --tokenizer NAME_OR_FOLDER"
        )
    if not special_tokens:
        return ids, ()
    plain, full = tok("a", add_special_tokens=False)["input_ids"], tok("a", add_special_tokens=True)["input_ids"]
    n_start = next((i for i in range(len(full)) if full[i : i + len(plain)] == plain), 0)
    return ids, tuple(int(t) for t in full[:n_start])
