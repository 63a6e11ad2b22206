"""Architectures qkgeom reads: where each model keeps W_Q and W_K, its q/k norm, its pre-rotary q/k.

This is the one place where an architecture is added (see Arch and ARCHS). The module imports no
torch or transformers at load time, so an unsupported model type is refused in well under a
second (check_model_type), before anything heavy is imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qkgeom.errors import QKGeomError

if TYPE_CHECKING:
    from torch import Tensor, nn


class PretrainedError(QKGeomError, ValueError):
    """A model, revision or input that cannot be analysed; the message names it."""


def _heads_from_linear(weight: Tensor, n_heads: int) -> Tensor:
    """nn.Linear weight (H*E, D) -> (H, D, E) in the q = x W convention."""
    return weight.detach().T.reshape(weight.shape[1], n_heads, -1).permute(1, 0, 2)


def _split(t: Tensor, heads: int) -> Tensor:
    """(B, T, H*E) -> (B, H, T, E)."""
    return t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)


def _attn_modules(model: nn.Module, attr: str) -> list[nn.Module]:
    return [
        m for m in model.modules() if hasattr(m, attr) and type(m).__name__.endswith(("Attention", "SelfAttention"))
    ]


def head_counts(model: nn.Module) -> tuple[int, int]:
    """(query heads, key heads) of a model's attention layers."""
    cfg = model.config
    H = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    if getattr(cfg, "multi_query", False):  # GPTBigCode's multi-query attention: one key head
        return H, 1
    return H, getattr(cfg, "num_key_value_heads", None) or H


@dataclass(frozen=True)
class Arch:
    """How to read one architecture. Adding one = one entry in ARCHS plus a config in
    tests/probing/test_pretrained.py's CONFIGS (the parity tests then cover it).

    layout: where W_Q and W_K live in each attention module:
      `conv1d_qkv` GPT-2 Conv1D c_attn (D, 3D) [q | k | v];  `neox_qkv` GPT-NeoX query_key_value,
      per-head interleaved [q|k|v];  `linear` separate q_proj / k_proj;  `bert` query / key;
      `fused_qkv` one qkv_proj Linear [q (H*E) | k (H_kv*E) | v] (Phi-3);  `bigcode` GPTBigCode c_attn
      Linear, [q (D) | k (E) | v (E)] when multi-query.
    qk_norm: `head` (RMSNorm over d_head after the projection: Qwen3, Gemma 3), `full` (over H*E:
      OLMo-2) or none. With one, the pre-rotary site records the *normalised* q/k (what enters the
      rotary), and weight metrics are also given with the norm gains folded in (site `norm_folded`).
    gain_offset: 1 where the norm multiplies by (1 + weight) (Gemma), else 0.
    norm_heads_first: the head norm sees (B, H, T, E) (Gemma 3) rather than (B, T, H, E) (Qwen3).
    """

    marker: str  # an attribute every attention module of this architecture has
    layout: str
    rotary: bool
    qk_norm: str = ""
    gain_offset: float = 0.0
    norm_heads_first: bool = False

    def weights(self, model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
        """Per layer W_Q^h (H, D, E) and W_K^h (H_kv, D, E)."""
        H, H_kv = head_counts(model)
        w_q, w_k = [], []
        for m in _attn_modules(model, self.marker):
            if self.layout == "conv1d_qkv":
                D = m.c_attn.weight.shape[0]
                w = m.c_attn.weight.detach()
                w_q.append(w[:, :D].reshape(D, H, -1).permute(1, 0, 2))
                w_k.append(w[:, D : 2 * D].reshape(D, H, -1).permute(1, 0, 2))
            elif self.layout == "neox_qkv":
                w = m.query_key_value.weight.detach().T  # (D, 3D)
                w = w.reshape(w.shape[0], H, 3, -1)
                w_q.append(w[:, :, 0].permute(1, 0, 2))
                w_k.append(w[:, :, 1].permute(1, 0, 2))
            elif self.layout == "linear":
                w_q.append(_heads_from_linear(m.q_proj.weight, H))
                w_k.append(_heads_from_linear(m.k_proj.weight, H_kv))
            elif self.layout == "fused_qkv":
                w, nq = m.qkv_proj.weight, m.o_proj.in_features  # rows: q (H*E), k (H_kv*E), v (H_kv*E)
                w_q.append(_heads_from_linear(w[:nq], H))
                w_k.append(_heads_from_linear(w[nq : nq + (w.shape[0] - nq) // 2], H_kv))
            elif self.layout == "bigcode":
                w, D = m.c_attn.weight, m.c_attn.weight.shape[1]
                if H_kv == 1:
                    E = (w.shape[0] - D) // 2
                    w_q.append(_heads_from_linear(w[:D], H))
                    w_k.append(_heads_from_linear(w[D : D + E], 1))
                else:  # per-head interleaved [q|k|v]
                    per = w.detach().reshape(H, 3, -1, D)
                    w_q.append(per[:, 0].transpose(1, 2))
                    w_k.append(per[:, 1].transpose(1, 2))
            else:  # bert
                w_q.append(_heads_from_linear(m.query.weight, H))
                w_k.append(_heads_from_linear(m.key.weight, H))
        return w_q, w_k

    def value_output(self, model: nn.Module) -> tuple[list[Tensor], list[Tensor] | None]:
        """Per layer W_V^h (H_kv, D, E) and W_O^h transposed (H, D, E): the E rows of the output
        projection that head h writes, as (D, E). W_O is None where it lives outside the attention
        module (BERT's sits in BertSelfOutput)."""
        H, H_kv = head_counts(model)
        w_v, w_o = [], []

        def out_rows(weight: Tensor) -> Tensor:  # nn.Linear (D, H*E) -> (H, D, E)
            return weight.detach().reshape(weight.shape[0], H, -1).permute(1, 0, 2)

        for m in _attn_modules(model, self.marker):
            if self.layout == "conv1d_qkv":  # Conv1D stores (in, out)
                D = m.c_attn.weight.shape[0]
                w_v.append(m.c_attn.weight.detach()[:, 2 * D :].reshape(D, H, -1).permute(1, 0, 2))
                w_o.append(m.c_proj.weight.detach().reshape(H, -1, D).transpose(1, 2))
            elif self.layout == "neox_qkv":
                w = m.query_key_value.weight.detach().T
                w_v.append(w.reshape(w.shape[0], H, 3, -1)[:, :, 2].permute(1, 0, 2))
                w_o.append(out_rows(m.dense.weight))
            elif self.layout == "fused_qkv":
                w, nq = m.qkv_proj.weight, m.o_proj.in_features
                w_v.append(_heads_from_linear(w[nq + (w.shape[0] - nq) // 2 :], H_kv))
                w_o.append(out_rows(m.o_proj.weight))
            elif self.layout == "bigcode":
                w, D = m.c_attn.weight, m.c_attn.weight.shape[1]
                if H_kv == 1:
                    E = (w.shape[0] - D) // 2
                    w_v.append(_heads_from_linear(w[D + E :], 1))
                else:
                    w_v.append(w.detach().reshape(H, 3, -1, D)[:, 2].transpose(1, 2))
                w_o.append(out_rows(m.c_proj.weight))
            elif self.layout == "bert":
                w_v.append(_heads_from_linear(m.value.weight, H))
            else:  # linear: v_proj, and o_proj (out_proj in OPT)
                w_v.append(_heads_from_linear(m.v_proj.weight, H_kv))
                o = getattr(m, "o_proj", None)
                w_o.append(out_rows((o if o is not None else m.out_proj).weight))
        return w_v, (w_o or None)

    def gains(self, model: nn.Module) -> tuple[list[Tensor], list[Tensor]] | None:
        """Per layer q/k norm gains as (H, E) and (H_kv, E), or None without a q/k norm."""
        if not self.qk_norm:
            return None
        H, H_kv = head_counts(model)
        g_q, g_k = [], []
        for m in _attn_modules(model, self.marker):
            gq = m.q_norm.weight.detach().float() + self.gain_offset
            gk = m.k_norm.weight.detach().float() + self.gain_offset
            g_q.append(gq.reshape(H, -1) if self.qk_norm == "full" else gq.expand(H, -1))
            g_k.append(gk.reshape(H_kv, -1) if self.qk_norm == "full" else gk.expand(H_kv, -1))
        return g_q, g_k

    def pre_rotary_hooks(self, model: nn.Module, store: dict[int, dict[str, Tensor]]) -> list:
        """Forward hooks recording pre-rotary q, k (B, H, T, E) per layer index: the projections'
        output, or the q/k norm's output where the model normalises q and k before the rotary."""
        if not self.rotary:
            return []
        H, H_kv = head_counts(model)
        handles = []

        def put(i: int, name: str, t: Tensor) -> None:
            store.setdefault(i, {})[name] = t.detach()

        for i, m in enumerate(_attn_modules(model, self.marker)):
            if self.layout == "neox_qkv":

                def hook(mod, inp, out, i=i):
                    q, k, _ = _split(out, H).chunk(3, dim=-1)  # per head [q|k|v]
                    put(i, "q", q)
                    put(i, "k", k)

                handles.append(m.query_key_value.register_forward_hook(hook))
            elif self.layout == "fused_qkv":

                def hook(mod, inp, out, i=i, m=m):
                    nq = m.o_proj.in_features
                    nk = (out.shape[-1] - nq) // 2
                    put(i, "q", _split(out[..., :nq], H))
                    put(i, "k", _split(out[..., nq : nq + nk], H_kv))

                handles.append(m.qkv_proj.register_forward_hook(hook))
            else:
                q_mod, k_mod = (m.q_norm, m.k_norm) if self.qk_norm else (m.q_proj, m.k_proj)

                def shaped(out: Tensor, heads: int) -> Tensor:
                    if out.dim() == 3:  # (B, T, H*E): a projection, or OLMo-2's norm over all heads
                        return _split(out, heads)
                    return out if self.norm_heads_first else out.transpose(1, 2)  # (B, H, T, E) or (B, T, H, E)

                handles.append(q_mod.register_forward_hook(lambda mod, inp, out, i=i: put(i, "q", shaped(out, H))))
                handles.append(k_mod.register_forward_hook(lambda mod, inp, out, i=i: put(i, "k", shaped(out, H_kv))))
        return handles


# The one place where an architecture is added (see Arch).
ARCHS = {
    "gpt2": Arch("c_attn", "conv1d_qkv", rotary=False),
    "gpt_bigcode": Arch("c_attn", "bigcode", rotary=False),
    "gpt_neox": Arch("query_key_value", "neox_qkv", rotary=True),
    "llama": Arch("q_proj", "linear", rotary=True),
    "qwen2": Arch("q_proj", "linear", rotary=True),
    "mistral": Arch("q_proj", "linear", rotary=True),
    "qwen3": Arch("q_proj", "linear", rotary=True, qk_norm="head"),
    "qwen2_moe": Arch("q_proj", "linear", rotary=True),  # the MoE models: their attention is the dense one's
    "qwen3_moe": Arch("q_proj", "linear", rotary=True, qk_norm="head"),
    "mixtral": Arch("q_proj", "linear", rotary=True),
    "starcoder2": Arch("q_proj", "linear", rotary=True),
    "granite": Arch("q_proj", "linear", rotary=True),  # scores scaled by attention_multiplier, not 1/sqrt(E)
    "olmo": Arch("q_proj", "linear", rotary=True),  # OLMo 1 (its clip_qkv clamps q, k in place: recorded clamped)
    "olmo2": Arch("q_proj", "linear", rotary=True, qk_norm="full"),
    "olmo3": Arch("q_proj", "linear", rotary=True, qk_norm="full"),
    "olmoe": Arch("q_proj", "linear", rotary=True, qk_norm="full"),
    "smollm3": Arch("q_proj", "linear", rotary=True),  # its NoPE layers: pre-rotary = post-rotary
    "gemma2": Arch("q_proj", "linear", rotary=True, gain_offset=1.0),
    "gemma3_text": Arch("q_proj", "linear", rotary=True, qk_norm="head", gain_offset=1.0, norm_heads_first=True),
    "phi3": Arch("qkv_proj", "fused_qkv", rotary=True),
    "opt": Arch("q_proj", "linear", rotary=False),
    "bert": Arch("query", "bert", rotary=False),
}
ADD_ARCH_HINT = (
    "add one in qkgeom/probing/archs.py (ARCHS, see Arch) with a parity test in tests/probing/test_pretrained.py"
)


def context_length(model: nn.Module) -> int | None:
    """The positions a model was built for: GPT-2's n_positions, else max_position_embeddings; None if neither."""
    return getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)


def arch_of(model: nn.Module) -> Arch:
    """The ARCHS row of a supported Hugging Face model; PretrainedError for any other."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt is None:
        raise PretrainedError(f"a {type(model).__name__} is not a Hugging Face model (no config.model_type); for any "
                              "other model, read q and k with hooks and call qkgeom.measure")  # fmt: skip
    if mt not in ARCHS:
        raise PretrainedError(f"unsupported model type {mt!r}; supported: {', '.join(sorted(ARCHS))}; {ADD_ARCH_HINT}")
    return ARCHS[mt]


def check_model_type(name: str, revision: str | None = None) -> None:
    """Refuse at once an unsupported local model (reads config.json only; hub names are checked after
    download by arch_of), and a path that names nothing and cannot be a hub name (was the hub's error
    after seconds of imports: "Repo id must be in the form ...")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # light: no torch, no transformers

    p = Path(name)
    if not p.exists():
        try:
            validate_repo_id(name)
        except HFValidationError:
            raise PretrainedError(f"no model folder at {name} (and it is no hub name: 'name' or 'org/name')") from None
    folder = p / revision if revision and (p / revision / "config.json").is_file() else p
    if (folder / "config.json").is_file():
        try:
            mt = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return  # transformers will report the broken file with its own message
        if mt is None and (folder / "vocab.json").is_file() and (folder / "checkpoints").is_dir():
            raise PretrainedError(
                f"{folder} is a `qkgeom train` run, not a Hugging Face model: export it first "
                f"(qkgeom export {folder} --out FOLDER), then analyse FOLDER --all-revisions"
            )
        if mt not in ARCHS:
            raise PretrainedError(
                f"unsupported model type {mt!r}; supported: {', '.join(sorted(ARCHS))}; {ADD_ARCH_HINT}"
            )


def resolve_revision(name: str, revision: str | None) -> tuple[str, str | None]:
    """A local folder holding one sub-folder per revision (e.g. an exported qkgeom run) maps
    (folder, revision) to (folder/revision, None); hub names pass through unchanged. A local folder that
    holds no config.json where the model should be is refused here, from the file system alone (it was
    refused after 7 s of imports)."""
    p = Path(name)
    if not p.is_dir():
        return name, revision
    if revision is not None and (p / revision / "config.json").is_file():
        return str(p / revision), None
    if revision is None and (p / "config.json").is_file():
        return name, revision
    subs = sorted(d.name for d in p.iterdir() if (d / "config.json").is_file())  # e.g. an export's steps
    if revision is not None:
        raise PretrainedError(f"revision {revision!r} does not exist in {p} (available: {', '.join(subs) or 'none'})")
    hint = f"; its revisions {', '.join(subs[:3])}{', ...' * (len(subs) > 3)} are read with --all-revisions"
    raise PretrainedError(f"{name} has no config.json: not a Hugging Face model folder{hint if subs else ''}")


# Where a metric exists at several sites, the one that describes what the model computes: for
# q/k-norm models the weight metrics with the norm gains folded in (`norm_folded`), for rotary
# models the q/k that enter the scores (`post_rotary`).
SITE_PREFERENCE = ("norm_folded", "post_rotary", "none", "pre_rotary")


def one_site(rows):
    """The rows (a DataFrame of one metric) at one site, by SITE_PREFERENCE, so (layer, head) is unique."""
    for site in SITE_PREFERENCE:
        if (rows["site"] == site).any():
            return rows[rows["site"] == site]
    return rows[rows["site"] == rows["site"].iloc[0]] if len(rows) else rows
