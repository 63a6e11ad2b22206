"""Shared fixtures: the real WikiText-2 mirror (QKGEOM_WIKITEXT_DIR) and an isolated cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qkgeom.training.data import wikitext_mirror

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _env(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["QKGEOM_WIKITEXT_DIR"] = str(wikitext_mirror())  # subprocesses see the same setting
    os.environ["QKGEOM_CACHE"] = str(tmp_path_factory.mktemp("cache"))


def unavailable(msg: str) -> None:
    """Something a test needs is missing: a failure under CI (which installs everything, so nothing may
    be skipped there), a clean skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def wikitext() -> Path:
    """Folder holding wikitext-2/{train,valid,test}.txt; a failure under CI, a skip elsewhere."""
    root = wikitext_mirror()
    if not (root / "wikitext-2" / "train.txt").is_file():
        unavailable(f"WikiText-2 mirror not found at {root} (set QKGEOM_WIKITEXT_DIR)")
    return root


def tiny_config(**sections):
    """The tiny preset with per-section overrides, e.g. tiny_config(train={"steps": 10})."""
    from qkgeom import config as C

    overrides = [f"{sec}.{k}={_toml(v)}" for sec, kv in sections.items() for k, v in kv.items()]
    return C.load("tiny", overrides)


def _toml(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def need(module: str):
    """Import an optional extra's module: a clean skip where it is absent, a failure under CI (which
    installs every extra, so that no test is skipped there)."""
    try:
        return __import__(module)
    except ImportError:
        unavailable(f"{module} is not installed (an optional extra; pip install -e '.[dev]')")


def tiny_llama_module(vocab: int, ctx: int):
    """A LightningModule around a tiny random Llama (rotary and grouped-query attention: two q/k sites),
    trained on its own input ids; for the Lightning callback tests."""
    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            config = LlamaConfig(
                vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=ctx,
            )  # fmt: skip
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    return LM()
