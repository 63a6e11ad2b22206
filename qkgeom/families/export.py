"""Our runs as Hugging Face models: every kept checkpoint of a qkgeom run written as a GPT-2
folder (revision `step_<n>`), so that `qkgeom pretrained EXPORT --all-revisions` reads a run as a
checkpoint family through the same Hugging Face path as a public suite."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from qkgeom.probing.hf import hf_quiet
from qkgeom.results import EXPORT_INFO, EXPORT_VOCAB, DamagedRunError, RunDir, read_json, revision_name, write_json


def _check_same_run(rd: RunDir, out: Path) -> None:
    """One export folder holds one run's checkpoints: another run's would silently join its family."""
    for info_file in sorted(out.glob(f"step_*/{EXPORT_INFO}")):
        other = read_json(info_file).get("run")
        if other is not None and Path(other) != rd.path.resolve():
            raise DamagedRunError(
                f"{out} holds checkpoints exported from another run ({other}); export {rd.path} into another folder"
            )


def _write_folder(target: Path, hf, vocab: str, info: dict) -> None:
    """One revision, whole or not at all: written into a temporary sibling, renamed into place last
    (a killed export leaves no half folder, and a rerun skips the revisions already there)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        try:
            with hf_quiet():  # one "Writing model shards" bar per revision otherwise
                hf.save_pretrained(tmp)
        except OSError:
            raise
        except Exception as e:  # safetensors reports a full disk as its own error type, not OSError
            raise OSError(f"cannot write {target}: {str(e).splitlines()[0]}") from None
        (tmp / EXPORT_VOCAB).write_text(vocab)
        write_json(tmp / EXPORT_INFO, info)  # last: its presence marks a whole revision
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_run(run_dir: str | Path, out: str | Path) -> list[Path]:
    """Write every checkpoint of a qkgeom run as a Hugging Face GPT-2 folder out/step_<n>/.

    Our GPT is GPT-2's architecture without biases: fused c_attn = [W_Q | W_K | W_V] (D, 3D),
    exact GELU, LayerNorm eps 1e-5, tied embeddings; biases are written as zeros. Returns the revision
    folders in step order.
    """
    rd = RunDir(run_dir)
    if not rd.config.is_file():
        raise DamagedRunError(f"{rd.path} is not a qkgeom run folder (no config.json)")
    cfg = read_json(rd.config)
    if "model" not in cfg.get("config", {}) or "vocab_size" not in cfg or not rd.vocab.is_file():
        raise DamagedRunError(f"{rd.path} is not a finished `qkgeom train` run (its config.json or vocab.json)")
    from transformers import GPT2Config, GPT2LMHeadModel  # after the checks: seconds to import

    m = cfg["config"]["model"]
    vocab = rd.vocab.read_text()
    out = Path(out)
    _check_same_run(rd, out)
    for stale in sorted(out.glob(".step_*.tmp")) if out.is_dir() else []:  # a killed export's half revision
        shutil.rmtree(stale, ignore_errors=True)
    written: dict[int, Path] = {}  # step -> revision folder
    for ckpt in sorted(rd.checkpoints.glob("*.pt")):
        state = rd.load_checkpoint(ckpt.name)
        step, sd = int(state["step"]), state["model"]
        target = out / revision_name(step)
        if step in written:  # last.pt is also a kept step
            continue
        if (target / EXPORT_INFO).is_file():  # exported whole by an earlier, interrupted export
            written[step] = target
            continue
        hf_cfg = GPT2Config(
            vocab_size=cfg["vocab_size"],
            n_positions=m["n_ctx"],
            n_embd=m["d_model"],
            n_layer=m["n_layers"],
            n_head=m["n_heads"],
            n_inner=m["d_mlp"] or 4 * m["d_model"],
            activation_function="gelu",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            bos_token_id=None,  # a character vocabulary has no start/end token (GPT-2's 50256 is out of range)
            eos_token_id=None,
        )
        hf = GPT2LMHeadModel(hf_cfg)
        new = {
            "transformer.wte.weight": sd["wte.weight"],
            "transformer.wpe.weight": sd["wpe.weight"],
            "transformer.ln_f.weight": sd["ln_f.weight"],
            "transformer.ln_f.bias": sd["ln_f.bias"],
        }
        for i in range(m["n_layers"]):
            b, h = f"blocks.{i}.", f"transformer.h.{i}."
            new[h + "attn.c_attn.weight"] = torch.cat([sd[b + "attn.W_Q"], sd[b + "attn.W_K"], sd[b + "attn.W_V"]], 1)
            new[h + "attn.c_proj.weight"] = sd[b + "attn.W_O"]
            new[h + "mlp.c_fc.weight"] = sd[b + "fc.weight"].T
            new[h + "mlp.c_proj.weight"] = sd[b + "proj.weight"].T
            for ln in ("ln1", "ln2"):
                hl = "ln_1" if ln == "ln1" else "ln_2"
                new[h + f"{hl}.weight"], new[h + f"{hl}.bias"] = sd[b + f"{ln}.weight"], sd[b + f"{ln}.bias"]
        missing = {k: torch.zeros_like(v) for k, v in hf.state_dict().items() if k not in new and k.endswith("bias")}
        hf.load_state_dict({**new, **missing}, strict=False)
        info = {"run": str(rd.path.resolve()), "run_id": rd.path.name, "step": step}
        _write_folder(target, hf, vocab, {**info, "tokens_per_step": cfg["tokens_per_step"]})
        written[step] = target
    if not written:
        raise DamagedRunError(
            f"{rd.path} has no checkpoints to export (train with --set train.keep_checkpoints=log to keep a family)"
        )
    return [written[s] for s in sorted(written)]  # in step order (the files sort as last, step_0, step_12, ...)
