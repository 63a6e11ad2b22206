"""family: our runs exported to Hugging Face give the native probe's numbers; revisions, hashing, trends."""

import json

import numpy as np
import pytest
import torch

from qkgeom.families import revisions as F
from qkgeom.families.config import load_pretrained
from qkgeom.families.export import export_run
from qkgeom.probing import hf as P
from qkgeom.probing.probe import probe_gpt
from qkgeom.training.data import fixed_offsets, gather, load_corpus
from qkgeom.training.loop import train
from qkgeom.training.model import GPT
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("wikitext")


def test_pythia_schedule():
    revs = F.pythia_revisions()
    assert revs[:12] == [
        "step0",
        "step1",
        "step2",
        "step4",
        "step8",
        "step16",
        "step32",
        "step64",
        "step128",
        "step256",
        "step512",
        "step1000",
    ]
    assert revs[-1] == "step143000" and len(revs) == 11 + 143
    sub = F.pythia_revisions(every=10)
    assert sub[11:13] == ["step10000", "step20000"] and sub[-1] == "step143000"
    assert F.step_of("step_1200") == 1200 and F.step_of("main") is None


def test_a_revision_named_twice_is_measured_once_and_every_needs_a_family():
    """`--revision step1000 --family pythia` (or `--revision step_20 --all-revisions`) listed the revision
    twice: the second was skipped as done, and the command counted it ("2 revision(s)"). `--every 10`
    without --family thinned nothing, silently; it is refused."""
    from qkgeom.errors import ConfigError

    pc = load_pretrained(None, ['model="EleutherAI/pythia-70m"', 'family="pythia"', 'revisions=["step1000", "x"]'])
    revs = F.family_revisions(pc)
    assert revs[:3] == ["step1000", "x", "step0"] and revs.count("step1000") == 1
    assert len(revs) == 2 + 11 + 143 - 1
    with pytest.raises(ConfigError, match="pretrained.every = 10 thins a family schedule or all_revisions; neither"):
        load_pretrained(None, ['model="EleutherAI/pythia-70m"', "every=10"])
    assert load_pretrained(None, ['model="m"', 'family="pythia"', "every=10"]).every == 10


def test_revision_names_give_step_tokens_and_stage():
    """The branch names of the checkpoint families on the hub: Pythia's, OLMo's, OLMo-2's, our exports'."""
    cases = {
        "step1000": (1000, None, 1),
        "step_20": (20, None, 1),
        "step20000-tokens84B": (20000, 84 * 10**9, 1),
        "stage1-step5000-tokens21B": (5000, 21 * 10**9, 1),
        "stage2-ingredient1-step1000-tokens5B": (1000, 5 * 10**9, 2),
        "step0-tokens0B": (0, 0, 1),
        "step3-tokens1.5M": (3, 1_500_000, 1),
        "main": (None, None, 1),
        "steps100": (None, None, 1),
        "mystep10": (None, None, 1),
    }
    for name, want in cases.items():
        assert (F.step_of(name), F.tokens_of(name), F.stage_of(name)) == want, name


def test_all_revisions_are_thinned_past_the_early_window():
    """--every k with --all-revisions: every revision up to --early-max-step (the early trend's window),
    then every k-th of the rest and the last, as --family pythia --every k thins Pythia's linear part."""
    revs = [f"step{s}-tokens{s}B" for s in (0, 500, 1000, 2000, 3000, 4000, 5000, 6000)]
    assert F.thinned(revs, 1, 1000) == revs
    assert [F.step_of(r) for r in F.thinned(revs, 2, 1000)] == [0, 500, 1000, 3000, 5000, 6000]
    assert [F.step_of(r) for r in F.thinned(revs, 3, 1000)] == [0, 500, 1000, 4000, 6000]
    assert [F.step_of(r) for r in F.thinned(revs, 10, 0)] == [0, 6000]
    assert F.pythia_revisions(10)[11:] == F.thinned(F.pythia_revisions(), 10, 512)[11:]  # the same rule
    assert F.thinned(["step_0", "step_2000", "step_3000", "final"], 2, 1000) == ["step_0", "step_3000", "final"]


def test_revisions_of_two_training_stages_are_refused():
    """OLMo-2's stage2-ingredient1-step1000 is not earlier than stage1-step5000: its steps restart, so a
    family that mixed the stages would put both on one step axis. One stage alone is a family."""
    mixed = ['model="allenai/OLMo-2-tiny"', 'revisions=["stage1-step5000-tokens21B", "stage2-ingredient1-step1000"]']
    with pytest.raises(P.PretrainedError, match="training stages 1, 2, whose steps restart"):
        F.family_revisions(load_pretrained(None, mixed))
    alone = ['model="m"', 'revisions=["stage2-ingredient1-step1000", "stage2-ingredient1-step2000", "main"]']
    assert F.family_revisions(load_pretrained(None, alone))[:2] == [
        "stage2-ingredient1-step1000",
        "stage2-ingredient1-step2000",
    ]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    cfg = tiny_config(train={"steps": 12, "checkpoint_steps": [0, 6]})
    rd = train(cfg, tmp / "run", progress=False)
    folders = export_run(rd.path, tmp / "hf")
    return cfg, rd, tmp / "hf", folders


def test_native_and_hugging_face_paths_agree(exported):
    cfg, rd, hf_root, folders = exported
    assert [f.name for f in folders] == ["step_0", "step_6", "step_12"]  # in step order (was last.pt's first)
    corpus = load_corpus(cfg.data)
    valid = corpus.splits["valid"]
    idx = torch.from_numpy(gather(valid, fixed_offsets(len(valid), cfg.model.n_ctx, 4), cfg.model.n_ctx)[0])
    model = GPT(cfg.model, corpus.vocab.size)
    model.load_state_dict(rd.load_checkpoint("step_6.pt")["model"])
    model.eval()
    native = {(r["layer"], r["head"], r["metric"]): r["value"] for r in probe_gpt(model, idx)[0]}
    hf = P.load_model(str(hf_root), "step_6")
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=idx).logits, model(idx), atol=1e-4)
    ours = {(r["layer"], r["head"], r["metric"]): r["value"] for r in P.analyse_model(hf, iter([idx]))[0]}
    checked = 0
    for key, v in native.items():
        if key[2] in (
            "query_participation_ratio",
            "key_participation_ratio",
            "attention_entropy",
            "attention_entropy_normalised",
            "interaction_rank",
            "logit_participation_ratio",
        ):
            assert ours[key] == pytest.approx(v, rel=1e-4), key
            checked += 1
    assert checked >= 6 * 2 * 5


def test_family_resume_hashing_and_trends(exported, tmp_path):
    cfg, rd, hf_root, _ = exported
    corpus = load_corpus(cfg.data)
    tokens = np.asarray(corpus.splits["valid"][:4096], dtype=np.int64)
    out = tmp_path / "fam"
    pc = load_pretrained(overrides=[f"model={json.dumps(str(hf_root))}", "n_tokens=2048", "seq_len=32", "batch_size=8"])
    for rev in ("step_0", "step_6", "step_12"):
        F.analyse_revision(pc, rev, out, lambda _: (tokens, ()))
    stamp = (out / "step_6" / "done.json").stat().st_mtime_ns
    F.analyse_revision(pc, "step_6", out, lambda _: (tokens, ()))  # resume: skipped
    assert (out / "step_6" / "done.json").stat().st_mtime_ns == stamp
    # a mislabeled copy: same weights under another revision name is flagged
    import shutil

    shutil.copytree(hf_root / "step_6", hf_root / "step_7")
    F.analyse_revision(pc, "step_7", out, lambda _: (tokens, ()))
    geometry, revs = F.load_family(out)
    assert list(revs["revision"]) == ["step_0", "step_6", "step_7", "step_12"]
    assert revs.set_index("revision").loc["step_7", "flag"] == "identical weights to step_6"
    assert (revs.set_index("revision").loc[["step_0", "step_6", "step_12"], "flag"] == "").all()
    assert revs.set_index("revision").loc["step_12", "tokens_seen"] == 12 * cfg.train.batch_size * cfg.model.n_ctx
    trends = F.family_trends(geometry, early_max_step=7)
    early = trends[
        (trends["window"] == "early") & (trends["layer"] == "mean") & trends["statistic"].str.startswith("Spearman")
    ].iloc[0]
    assert early["n"] == 3  # steps 0, 6, 7
    per_rev = trends[trends["statistic"] == "Spearman(interaction rank, attention entropy) across heads"]
    assert set(per_rev["window"]) == {"step_0", "step_6", "step_7", "step_12"} and (per_rev["n"] == 8).all()
    with pytest.raises(P.PretrainedError, match="revision 'step_99' does not exist"):
        P.load_model(str(hf_root), "step_99")


def test_cli_export_then_pretrained_family(exported, tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    _, rd, _, _ = exported
    run = [sys.executable, "-m", "qkgeom.cli"]
    r = subprocess.run(
        run + ["export", str(rd.path), "--out", str(tmp_path / "hf")], capture_output=True, text=True, cwd=REPO
    )
    assert r.returncode == 0 and "exported 3 checkpoints" in r.stdout, r.stderr
    # the README's example as written: the default --seq-len 256 exceeds the tiny model's context (32)
    r = subprocess.run(
        run
        + [
            "pretrained",
            str(tmp_path / "hf"),
            "--all-revisions",
            "--n-tokens",
            "2048",
            "--batch-size",
            "4",
            "--out",
            str(tmp_path / "fam"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    revs = (tmp_path / "fam" / "revisions.csv").read_text()
    assert "step_0" in revs and "step_12" in revs and (tmp_path / "fam" / "report" / "family_contrast.png").is_file()
    assert "token id" not in r.stderr.lower() and "bos_token" not in r.stderr.lower(), r.stderr  # no OOV ids
    r = subprocess.run(  # the same folder under another --n-tokens would mix two measurements in one family
        run + ["pretrained", str(tmp_path / "hf"), "--all-revisions", "--n-tokens", "1024", "--batch-size", "4",
               "--out", str(tmp_path / "fam"), "--no-progress"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "already holds revisions measured with n_tokens = 2048" in r.stderr
    r = subprocess.run(
        run + ["pretrained", str(tmp_path / "hf"), "--revision", "step_3", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2 and "revision 'step_3' does not exist" in r.stderr and r.stderr.count("\n") == 1


def test_single_model_is_a_complete_result(exported, tmp_path):
    # one revision, as `qkgeom pretrained MODEL` gives: figures, per-layer values and the across-heads
    # correlation of interaction rank and entropy; no trend rows over a single step (were NaN rows)
    import subprocess
    import sys

    import pandas as pd

    from tests.conftest import REPO

    _, _, hf_root, _ = exported
    out = tmp_path / "one"
    r = subprocess.run(
        [sys.executable, "-m", "qkgeom.cli", "pretrained", str(hf_root / "step_12"), "--n-tokens", "1024",
         "--batch-size", "4", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    trends = pd.read_csv(out / "trends.csv")
    assert list(trends["statistic"]) == [
        "Spearman(interaction rank, attention entropy) across heads",
        "Spearman(interaction rank, normalised entropy) across heads within layer",  # claim 4b, any model
    ]
    assert trends["n"].iloc[0] == 2 * 4 and np.isfinite(trends["rho"].iloc[0])  # 2 layers x 4 heads
    within = trends.iloc[1]
    assert within["n"] == 8 and -1 <= within["rho"] <= 1 and 1 / 2001 <= within["p_value"] <= 1  # permutation p
    html = (out / "report" / "index.html").read_text()
    assert (out / "report" / "model_heads.png").is_file() and "model_heads" in html and "Per-layer values" in html


@pytest.mark.usefixtures("wikitext")
def test_kept_log_checkpoints_export_as_a_family_with_trends(tmp_path, capsys):
    # a run keeps ~16 log-spaced checkpoints; exported, they read back as a family through the
    # Hugging Face path, with trend rows over steps
    import pandas as pd

    from qkgeom.cli import main
    from qkgeom.results import read_json

    run, hf, fam = tmp_path / "run", tmp_path / "hf", tmp_path / "fam"
    train_args = ["train", "tiny", "--no-progress", "--set", "train.steps=40", "--set", 'train.keep_checkpoints="log"']
    assert main([*train_args, "--out", str(run)]) == 0, capsys.readouterr().err
    kept = read_json(run / "config.json")["kept_checkpoints"]
    assert kept == [0, 1, 2, 3, 4, 6, 7, 9, 12, 15, 19, 24, 31, 40]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")) == sorted(f"step_{s}.pt" for s in kept)
    assert main(["export", str(run), "--out", str(hf)]) == 0
    args = ["--all-revisions", "--n-tokens", "512", "--seq-len", "32", "--batch-size", "4", "--no-progress"]
    assert main(["pretrained", str(hf), "--out", str(fam), *args]) == 0, capsys.readouterr().err
    revs = pd.read_csv(fam / "revisions.csv")
    assert len(revs) == len(kept) >= 5 and list(revs["step"]) == kept
    assert list(revs["tokens_seen"]) == [s * 8 * 32 for s in kept]  # tiny: batch 8 x n_ctx 32
    trends = pd.read_csv(fam / "trends.csv")
    early = trends[
        (trends["window"] == "early") & (trends["layer"] == "mean") & trends["statistic"].str.startswith("Spearman")
    ]
    assert len(early) == 1 and early["n"].iloc[0] == len(kept)


def test_export_of_a_run_without_checkpoints_is_refused(tmp_path, capsys):
    from qkgeom.cli import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"config": {"model": {}}, "vocab_size": 3, "tokens_per_step": 1}')
    (tmp_path / "run" / "vocab.json").write_text('{"kind": "char", "chars": "ab"}')
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    assert "has no checkpoints to export" in capsys.readouterr().err


def test_export_is_whole_per_revision_resumable_and_one_run_per_folder(exported, tmp_path, monkeypatch, capfd):
    from transformers import GPT2LMHeadModel

    from qkgeom.results import DamagedRunError

    _, rd, _, _ = exported
    save, calls = GPT2LMHeadModel.save_pretrained, []

    def dies_on_the_second(self, folder, *a, **kw):
        calls.append(folder)
        save(self, folder, *a, **kw)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")  # after the weights, before the folder is complete

    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", dies_on_the_second)
    with pytest.raises(OSError, match="No space left"):
        export_run(rd.path, tmp_path / "hf")
    monkeypatch.undo()
    left = sorted((tmp_path / "hf").iterdir())  # the first revision whole; no half folder, no temp left
    assert len(left) == 1 and left[0].name.startswith("step_") and (left[0] / "qkgeom_export.json").is_file()
    capfd.readouterr()
    assert sorted(f.name for f in export_run(rd.path, tmp_path / "hf")) == ["step_0", "step_12", "step_6"]
    assert "Writing model shards" not in capfd.readouterr().err  # no bar per revision under the caller's
    cfg = json.loads((tmp_path / "hf" / "step_6" / "config.json").read_text())
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None  # GPT-2's 50256 is outside our vocabulary

    other = train(tiny_config(train={"steps": 4, "seed": 1}), tmp_path / "other", progress=False)
    with pytest.raises(DamagedRunError, match="holds checkpoints exported from another run"):
        export_run(other.path, tmp_path / "hf")


def test_a_torn_export_is_never_read_as_a_revision(exported, tmp_path):
    """A killed export (SIGKILL: no except clause runs) leaves a hidden .step_N.*.tmp folder holding a
    config.json, and a revision without its completion marker; --all-revisions read both as revisions,
    even after a successful re-export. Now only marked revisions count and a re-export cleans the temp."""
    import shutil

    _, rd, hf_root, _ = exported
    hf = tmp_path / "hf"
    shutil.copytree(hf_root, hf)
    whole = sorted(F.local_revisions(hf))  # the fixture's revisions (other tests may have added some)
    assert {"step_0", "step_6", "step_12"} <= set(whole)
    torn = hf / ".step_6.x1y2.tmp"
    shutil.copytree(hf / "step_6", torn)
    (torn / "qkgeom_export.json").unlink()  # killed before its marker
    shutil.copytree(hf / "step_6", hf / "step_9")
    (hf / "step_9" / "qkgeom_export.json").unlink()  # a revision folder without the marker
    assert sorted(F.local_revisions(hf)) == whole
    export_run(rd.path, hf)
    assert not torn.exists() and sorted(F.local_revisions(hf)) == whole
    revisions = F.family_revisions(load_pretrained(None, [f"model={json.dumps(str(hf))}", "all_revisions=true"]))
    assert sorted(revisions) == whole and "step_9" not in revisions


def test_report_says_which_revisions_it_left_out(tmp_path):
    from qkgeom.results import RunDir

    fam = tmp_path / "fam"
    for name in ("step_1", "step_2", ".step_3.tmp"):
        RunDir(fam / name).path.mkdir(parents=True)
        (fam / name / "config.json").write_text("{}")
    (fam / "step_1" / "done.json").write_text("{}")
    (fam / "report").mkdir()
    assert F.left_out_revisions(fam) == [
        ".step_3.tmp (a temp folder of a killed write)",
        "step_2 (unfinished: no done.json)",
    ]


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    """Measured as if right before: n_layer 3 against 2-layer weights reported a layer that does not
    exist, and a missing tensor was measured at its random initialisation."""
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=32)).save_pretrained(
        tmp_path / "g"
    )
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    # missing: the Q/K/V bias counts now; unexpected: 11, or 12 where transformers (5.0) also names attn.bias
    for n_layer, says in ((3, r"12 missing \(transformer\.h\.2\."), (1, r"1[12] unexpected \(transformer\.h\.1\.")):
        (tmp_path / "g" / "config.json").write_text(json.dumps({**config, "n_layer": n_layer}))
        with pytest.raises(P.PretrainedError, match=f"do not match its config.json: {says}"):
            P.load_model(str(tmp_path / "g"))
    (tmp_path / "g" / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "g" / "model.safetensors")
    del weights["transformer.h.1.attn.c_attn.weight"]
    save_file(weights, tmp_path / "g" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(P.PretrainedError, match=r"1 missing \(transformer.h.1.attn.c_attn.weight\)"):
        P.load_model(str(tmp_path / "g"))
    # a missing Q/K/V bias was loaded as zeros: `attn.bias` (the old mask buffer) also matched `c_attn.bias`
    weights = load_file(tmp_path / "g" / "model.safetensors")
    weights["transformer.h.1.attn.c_attn.weight"] = torch.zeros(32, 96)
    del weights["transformer.h.0.attn.c_attn.bias"]
    save_file(weights, tmp_path / "g" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(P.PretrainedError, match=r"1 missing \(transformer.h.0.attn.c_attn.bias\)"):
        P.load_model(str(tmp_path / "g"))
    # the mask buffer itself stays harmless, missing or unexpected
    assert P._HARMLESS.search("transformer.h.0.attn.bias") and P._HARMLESS.search("h.3.attn.masked_bias")
    assert not P._HARMLESS.search("transformer.h.0.attn.c_attn.bias")


def test_bad_pretrained_folders_are_one_line_errors(exported, tmp_path, capsys):
    from qkgeom.cli import main

    _, _, hf_root, _ = exported
    (tmp_path / "empty").mkdir()
    nan = tmp_path / "nan"
    model = P.load_model(str(hf_root / "step_6"))
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[1, 2] = float("nan")  # crashed with an IndexError
    model.save_pretrained(nan)
    (nan / "qkgeom_vocab.json").write_text((hf_root / "step_6" / "qkgeom_vocab.json").read_text())
    notok = tmp_path / "notok"  # a model folder with no tokenizer files and no qkgeom vocabulary
    model.save_pretrained(notok)
    cases = [
        (tmp_path / "empty", [], "has no config.json: not a Hugging Face model folder"),
        (nan, [], "weights are not finite (transformer.h.0.attn.c_attn.weight: 1 NaN, 0 inf of"),
        (notok, [], "turns the text into 0 tokens (a folder without tokenizer files?); pass --tokenizer"),
        # an export is read with its own vocabulary: a --tokenizer was ignored, yet recorded as the one used
        (hf_root / "step_6", ["--tokenizer", "gpt2"], "exported qkgeom run, read with its own vocabulary"),
    ]
    for folder, extra, says in cases:
        args = ["pretrained", str(folder), "--n-tokens", "512", "--batch-size", "2", "--no-progress", *extra]
        rc = main([*args, "--out", str(tmp_path / "out" / folder.name)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and says in err[-1] and err[-1].startswith("qkgeom pretrained: error:"), (folder.name, err)
        assert not (tmp_path / "out" / folder.name).exists()  # nothing half-written
