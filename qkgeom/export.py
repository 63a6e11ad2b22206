"""Our runs as Hugging Face models: every kept checkpoint of a qkgeom run written as a GPT-2
folder (revision `step_<n>`), so that `qkgeom pretrained EXPORT --all-revisions` reads a run as a
checkpoint family through the same Hugging Face path as a public suite."""

from __future__ import annotations

from pathlib import Path

import torch

from qkgeom.results import DamagedRunError, RunDir, read_json, write_json


def export_run(run_dir: str | Path, out: str | Path) -> list[Path]:
    """Write every checkpoint of a qkgeom run as a Hugging Face GPT-2 folder out/step_<n>/.

    Our GPT is GPT-2's architecture without biases: fused c_attn = [W_Q | W_K | W_V] (D, 3D),
    exact GELU, LayerNorm eps 1e-5, tied embeddings; biases are written as zeros.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    rd = RunDir(run_dir)
    cfg = read_json(rd.config)
    m = cfg["config"]["model"]
    vocab = rd.vocab.read_text()
    written: list[Path] = []
    for ckpt in sorted(rd.checkpoints.glob("*.pt")):
        state = rd.load_checkpoint(ckpt.name)
        step, sd = int(state["step"]), state["model"]
        target = Path(out) / f"step_{step}"
        if target in written:  # last.pt is also a kept step
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
        hf.save_pretrained(target)
        (target / "qkgeom_vocab.json").write_text(vocab)
        write_json(
            target / "qkgeom_export.json",
            {"run": str(rd.path), "step": step, "tokens_per_step": cfg["tokens_per_step"]},
        )
        written.append(target)
    if not written:
        raise DamagedRunError(
            f"{rd.path} has no checkpoints to export (train with --set train.keep_checkpoints=log to keep a family)"
        )
    return written
