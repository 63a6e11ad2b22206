"""`qkgeom pretrained` end to end through the CLI for every architecture in archs.ARCHS: a random
model built from its config (q/k-norm ones included) goes to its report, the report re-renders from
the finished folder, and a 3-revision family of it gets trend rows. No hub: the models are saved to
local folders with a character vocabulary (qkgeom_vocab.json) for the WikiText-2 sample."""

import copy

import pandas as pd
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from qkgeom.cli import main
from qkgeom.probing import archs
from qkgeom.training.data import build_vocab
from tests.probing.test_pretrained import CONFIGS

pytestmark = pytest.mark.usefixtures("wikitext")
SMALL_RUN = ["--n-tokens", "256", "--seq-len", "32", "--batch-size", "4", "--no-progress"]


def test_every_supported_architecture_has_a_config_here():
    assert set(CONFIGS) == set(archs.ARCHS)


def _save(name: str, folder, vocab, seed: int) -> None:
    cfg = copy.deepcopy(CONFIGS[name])
    cfg.vocab_size = vocab.size
    torch.manual_seed(seed)
    model = (AutoModel if name == "bert" else AutoModelForCausalLM).from_config(cfg)
    model.save_pretrained(folder)
    (folder / "qkgeom_vocab.json").write_text(vocab.to_json())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pretrained_cli_to_report_and_family(name, wikitext, tmp_path, capsys):
    vocab = build_vocab(wikitext / "wikitext-2-raw" / "valid.txt", "char")
    one = tmp_path / "model"
    _save(name, one, vocab, 0)
    out = tmp_path / "out"
    assert main(["pretrained", str(one), "--out", str(out), *SMALL_RUN]) == 0, capsys.readouterr().err
    index = out / "report" / "index.html"
    first = index.read_text()
    assert "model_heads" in first and "<h1>model: " in first and "checkpoint family" not in first
    assert "layers with PR_Q &gt; PR_K" in first and "interaction rank vs attention entropy" in first
    index.unlink()
    assert main(["report", str(out)]) == 0, capsys.readouterr().err  # re-render from the finished folder
    assert index.is_file()
    trends = pd.read_csv(out / "trends.csv")
    assert trends["n"].iloc[0] == 2 * CONFIGS[name].num_attention_heads  # every (layer, head) once

    family = tmp_path / "family"
    for seed, step in enumerate((0, 10, 100)):
        _save(name, family / f"step_{step}", vocab, seed)
    fam_out = tmp_path / "fam"
    assert main(["pretrained", str(family), "--all-revisions", "--out", str(fam_out), *SMALL_RUN]) == 0
    trends = pd.read_csv(fam_out / "trends.csv")
    early = trends[
        (trends["window"] == "early") & (trends["layer"] == "mean") & trends["statistic"].str.startswith("Spearman")
    ]
    assert len(early) == 1 and early["n"].iloc[0] == 3
    assert (fam_out / "report" / "family_contrast.png").is_file()
    _check_family_dataset(fam_out, name)


def _check_family_dataset(fam_out, name):
    """family.parquet: the tidy dataset, one row per checkpoint x layer x head x site x metric."""
    from qkgeom.families.revisions import FAMILY_DATASET_COLUMNS

    data = pd.read_parquet(fam_out / "family.parquet")
    assert list(data.columns) == FAMILY_DATASET_COLUMNS
    assert (
        sorted(data["step"].unique()) == [0, 10, 100]
        and not data.duplicated(["revision", "layer", "head", "site", "metric"]).any()
    )
    pr = data[data["metric"] == "key_participation_ratio"]
    assert (pr["convention"] == "variance").all()
    assert data[data["metric"] == "attention_entropy"]["convention"].isna().all()
    nan_alpha = data[data["metric"].str.endswith("_alpha") & data["value"].isna()]
    assert nan_alpha["note"].notna().all()  # every alpha without a fit says why
    one = pd.read_parquet(fam_out / "step_10" / "geometry.parquet")
    heads = one[(one["metric"] == "key_participation_ratio") & (one["head"] >= 0)].set_index(["site", "layer", "head"])
    mine = pr[(pr["step"] == 10) & (pr["head"] >= 0)].set_index(["site", "layer", "head"])["value"]
    assert mine.sort_index().to_numpy() == pytest.approx(heads["value"].sort_index().to_numpy())
