"""Every metric a run emits has its entry in docs/GLOSSARY.md's metric table (issue 55): a new metric
without a definition, range and gauge reading fails here."""

import fnmatch
import re

import numpy as np
import pandas as pd
import pytest

from tests.conftest import REPO, tiny_config


def glossary_names() -> list[str]:
    """The metric table's names: every backticked name in its first column (`*_x` a family)."""
    text = (REPO / "docs" / "GLOSSARY.md").read_text()
    table = text[text.index("| metric |") : text.index("\n\n", text.index("| metric |"))]
    return [n for line in table.splitlines()[2:] for n in re.findall(r"`([^`]+)`", line.split("|")[1])]


@pytest.mark.usefixtures("wikitext")
def test_every_emitted_metric_has_a_glossary_entry(tmp_path):
    from qkgeom.training.loop import train

    names = glossary_names()
    assert "key_participation_ratio" in names and "*_effective_rank" in names
    # a controlled run emits its control's metrics too
    for kind, arm in (("none", {}), ("hold", {"kind": "hold"})):
        train(tiny_config(train={"steps": 12}, intervention=arm), tmp_path / kind, progress=False)
    emitted = set()
    for kind in ("none", "hold"):
        emitted |= set(pd.read_parquet(tmp_path / kind / "geometry.parquet")["metric"])
    missing = sorted(m for m in emitted if not any(fnmatch.fnmatchcase(m, n) for n in names))
    assert missing == []


def glossary_rows() -> dict[str, list[str]]:
    """The metric table's rows by name: its cells (definition, range / units, gauge-invariant)."""
    text = (REPO / "docs" / "GLOSSARY.md").read_text()
    table = text[text.index("| metric |") : text.index("\n\n", text.index("| metric |"))]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells[1:]
    return rows


def test_the_metric_table_agrees_with_the_glossary_and_the_probe():
    """qkgeom.metrics.METRICS, which tables, figures and dashboards read for labels, says of each metric
    what the glossary and the probe say: the gauge-invariant column, the unit, whether a convention
    shapes it (the probe's PR and alpha metrics, whose rows name their convention)."""
    from qkgeom.metrics import METRICS, metric_label
    from qkgeom.probing import geometry as G
    from qkgeom.probing.weights import ALPHA_METRICS

    rows = glossary_rows()
    alphas = set(ALPHA_METRICS.values())
    for name, m in METRICS.items():
        assert name in rows, f"{name} has no glossary row"
        assert rows[name][2] == ("yes" if m.gauge_invariant else "no"), name
        assert not m.unit or m.unit in rows[name][1], name
        assert m.convention == (G.is_pr_metric(name) or name in alphas), name
    assert metric_label("attention_entropy") == "attention entropy (nats)" and metric_label("x_y") == "x_y"


def test_gauge_invariant_metrics_do_not_move_under_the_gauge_and_the_others_do():
    """The gauge_invariant flag is a fact about the probe: W_Q^h -> W_Q^h A_h, W_K^h -> W_K^h A_h^-T
    (a random invertible A_h per head) leaves every attention score, and so every metric flagged
    invariant, unchanged (1e-6 relative), while PR_Q and PR_K move."""
    import torch

    from qkgeom import config as C
    from qkgeom.metrics import METRICS
    from qkgeom.probing.probe import probe_gpt
    from qkgeom.training.model import GPT

    cfg = C.load("tiny")
    model = GPT(cfg.model, vocab_size=40, seed=1).double().eval()
    idx = torch.randint(0, 40, (6, cfg.model.n_ctx), generator=torch.Generator().manual_seed(0))
    settings = C.ProbeSettings(logit_seqs=None)

    def layer_values() -> dict:
        rows = pd.DataFrame(probe_gpt(model, idx, settings)[0])
        return rows[rows["head"] == -1].set_index(["layer", "metric"])["value"]

    before = layer_values()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in model.blocks:
            H, E = b.attn.n_heads, b.attn.W_Q.shape[1] // b.attn.n_heads
            for h in range(H):
                a = torch.eye(E, dtype=torch.float64) + 0.5 * torch.randn(E, E, generator=g, dtype=torch.float64)
                cols = slice(h * E, (h + 1) * E)
                b.attn.W_Q[:, cols] = b.attn.W_Q[:, cols] @ a
                b.attn.W_K[:, cols] = b.attn.W_K[:, cols] @ torch.linalg.inv(a).T
    after = layer_values()
    for name, m in METRICS.items():
        if name not in before.index.get_level_values("metric"):
            continue  # a metric this run does not emit (e.g. alpha at d_head below WeightWatcher's minimum)
        x, y = before.xs(name, level="metric"), after.xs(name, level="metric")
        same = np.allclose(x, y, rtol=1e-6, equal_nan=True)
        assert same == m.gauge_invariant or name.endswith("_alpha") and x.isna().all(), name
    assert not np.allclose(before.xs("key_participation_ratio", level="metric"),
                           after.xs("key_participation_ratio", level="metric"), rtol=1e-3)  # fmt: skip
