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
from qkgeom.results import read_json
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
    olmo = name.startswith("olmo")  # named as the OLMo families' branches are: stage, step, tokens
    revision = (lambda step: f"stage1-step{step}-tokens{4 * step}B") if olmo else (lambda step: f"step_{step}")
    for seed, step in enumerate((0, 10, 100)):
        _save(name, family / revision(step), vocab, seed)
    fam_out = tmp_path / "fam"
    assert main(["pretrained", str(family), "--all-revisions", "--out", str(fam_out), *SMALL_RUN]) == 0
    info = read_json(fam_out / revision(10) / "config.json")
    assert (info["step"], info["tokens_seen"]) == (10, 40 * 10**9 if olmo else None)  # the name's tokens
    trends = pd.read_csv(fam_out / "trends.csv")
    early = trends[
        (trends["window"] == "early") & (trends["layer"] == "mean") & trends["statistic"].str.startswith("Spearman")
    ]
    assert len(early) == 1 and early["n"].iloc[0] == 3
    assert (fam_out / "report" / "family_contrast.png").is_file()
    _check_family_dataset(fam_out, revision(10))


def _check_family_dataset(fam_out, tenth: str):
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
    one = pd.read_parquet(fam_out / tenth / "geometry.parquet")
    heads = one[(one["metric"] == "key_participation_ratio") & (one["head"] >= 0)].set_index(["site", "layer", "head"])
    mine = pr[(pr["step"] == 10) & (pr["head"] >= 0)].set_index(["site", "layer", "head"])["value"]
    assert mine.sort_index().to_numpy() == pytest.approx(heads["value"].sort_index().to_numpy())


class _Hub:
    """The hub's refs API on loopback: GET /api/models/<org>/<name>/refs -> its branches, 404 otherwise."""

    def __init__(self, repos: dict[str, list[str]]):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                repo = self.path.split("?")[0].removeprefix("/api/models/").removesuffix("/refs")
                if repo not in repos:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.end_headers()
                    return
                refs = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": "0" * 40} for b in repos[repo]]
                body = json.dumps({"branches": refs, "converts": [], "tags": []}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_all_revisions_of_a_hub_model_are_its_step_branches(tmp_path, monkeypatch, capsys):
    """`--all-revisions` on a hub name lists the model's branches named by a training step (OLMo's
    step1000-tokens4B), in step order, its first training stage only (a later one restarts its steps),
    thinned by --every past the early window; `--dry-run` lists them and which are done, loading no
    model. Against the hub's refs API served on loopback."""
    from huggingface_hub import constants

    branches = ["main", "step2000-tokens8B", "step0-tokens0B", "step1000-tokens4B", "step3000-tokens13B",
                "step4000-tokens17B", "step5000-tokens21B", "stage2-ingredient1-step1000-tokens5B"]  # fmt: skip
    hub = _Hub({"allenai/OLMo-tiny": branches, "org/no-steps": ["main", "v1"]})
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    out = tmp_path / "out"
    (out / "step1000-tokens4B").mkdir(parents=True)
    (out / "step1000-tokens4B" / "done.json").write_text("{}")
    try:
        cmd = ["pretrained", "allenai/OLMo-tiny", "--all-revisions", "--out", str(out), "--dry-run"]
        assert main([*cmd, "--every", "2", "--early-max-step", "1000"]) == 0
        got = capsys.readouterr()
        assert got.out.splitlines() == [
            "to do  step0-tokens0B",
            "done   step1000-tokens4B",
            "to do  step3000-tokens13B",
            "to do  step5000-tokens21B",
            f"4 revision(s) of allenai/OLMo-tiny (1 done) -> {out}",
        ]
        assert "1 revision(s) of allenai/OLMo-tiny from later training stages left out" in got.err
        assert main(cmd) == 0 and capsys.readouterr().out.count("\n") == 6 + 1  # all six, and the count
        assert main(["pretrained", "org/no-steps", "--all-revisions", "--dry-run"]) == 2
        assert "has no branch named by a training step on the hub (branches: main, v1)" in capsys.readouterr().err
        assert main(["pretrained", "org/missing", "--all-revisions", "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("qkgeom pretrained: error: cannot list the revisions of org/missing on the hub: 404")
        assert err.count("\n") == 1
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        assert main(cmd) == 2 and "HF_HUB_OFFLINE is set: name the cached revisions" in capsys.readouterr().err
    finally:
        hub.close()
