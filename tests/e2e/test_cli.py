"""cli: help that agrees with the study files, --version, and errors a user can trust (bad input:
one line, exit 2; a bug: traceback, exit 1)."""

import subprocess
import sys

import pytest

from qkgeom import config as C
from qkgeom.analysis.claims import arm_label
from qkgeom.training import grid as G
from tests.conftest import REPO


def qk(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkgeom.cli", *args], capture_output=True, text=True, cwd=REPO, env=env
    )


def test_study_help_agrees_with_every_study_file():
    text = qk("study", "--help").stdout
    for f in sorted(C.CONFIG_DIR.glob("study-*.toml")):
        name = f.stem.removeprefix("study-")
        runs = G.expand(G.load_sweep(name))  # the runs the study really has
        line = next(x for x in text.splitlines() if x.strip().startswith(name + " "))
        assert f"{len(runs)} runs on the " in line, line
        arms = {arm_label(C.to_dict(r.config)["intervention"]) for r in runs}
        if len(arms) > 1:
            assert f"{len(arms)} arms" in line, line
    # keys varied together are shown together (was `eval_every in [[1000, 50, 50], ...]`, one of three)
    ladder = "4 settings of steps/every/eval_every (1000/50/50, 2000/100/100, 4000/200/200, 8000/400/400) x 8 seeds"
    assert ladder in text


def test_version():
    r = qk("--version")
    assert r.returncode == 0 and r.stdout.startswith("qkgeom ")


def test_a_bug_shows_its_traceback_and_exits_1(tmp_path):
    # a deliberately raised internal error: not a user's mistake, so no one-line "error:"
    code = (
        "import sys; import qkgeom.cli as cli; "
        "cli.cmd_analyze = lambda args: (_ for _ in ()).throw(KeyError('internal'));"
        "cli.build_parser.__globals__['cmd_analyze'] = cli.cmd_analyze; sys.exit(cli.main(['analyze', sys.argv[1]]))"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "Traceback" in r.stderr and "this is a bug in qkgeom" in r.stderr, r.stderr


def test_windows_gets_one_line_not_a_traceback():
    """Windows has no fcntl (the run-folder locks) and no SIGPIPE: `import qkgeom` must still work there and
    the CLI say in one line where qkgeom runs (README, "Where it runs"). Stood in for by a process whose
    fcntl cannot be imported and whose os.name reads "nt" (on the code before, it failed at `import fcntl`)."""
    code = (
        "import os, sys; sys.modules['fcntl'] = None\n"  # import fcntl now raises ImportError
        "import qkgeom, qkgeom.results\nfrom qkgeom import cli\nos.name = 'nt'\nsys.exit(cli.main(['verdicts']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stderr[-500:]
    assert r.stderr == "qkgeom: error: qkgeom runs on Linux and macOS; on Windows, run it under WSL\n"


@pytest.mark.parametrize("debug, traceback", [("", False), ("1", True)])
def test_bad_input_is_one_line_unless_debugging(tmp_path, debug, traceback):
    import os

    env = dict(os.environ, QKGEOM_DEBUG=debug)
    r = qk("analyze", str(tmp_path), env=env)
    assert r.returncode == 2 and "no finished runs" in r.stderr
    assert ("Traceback" in r.stderr) == traceback
    if not traceback:
        assert r.stderr.count("\n") == 1


def test_a_refused_config_and_the_reading_commands_never_import_torch(tmp_path):
    """Importing torch takes 1.6 s of a 2-4 s command. A config `qkgeom train` refuses, `qkgeom report` (the
    analysis and the figures) and `qkgeom verdicts` on a committed study need none of it (torch comes in only
    to count the parameters of runs recorded before done.json kept that count), nor does `qkgeom pretrained`
    on a folder that holds no model (it said so after 7 s of torch and transformers). Checked structurally,
    not timed: in one process, every command done, neither may be in sys.modules."""
    import shutil

    study = tmp_path / "results" / "study-trainer-gpt2"
    shutil.copytree(REPO / "docs" / "results" / study.name, study)
    (tmp_path / "export" / "step_1").mkdir(parents=True)  # an export's layout, read without --all-revisions
    (tmp_path / "export" / "step_1" / "config.json").write_text('{"model_type": "gpt2"}')
    code = (
        "import sys; from qkgeom.cli import main; "
        "rcs = [main(['train', 'tiny', '--set', 'model.dropout=0.1']), main(['report', sys.argv[1]]), "
        "main(['verdicts', sys.argv[2]]), main(['pretrained', sys.argv[3]]), "
        "main(['pretrained', sys.argv[3], '--revision', 'step_2'])]; "
        "print(rcs, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    argv = [str(study), str(study.parent), str(tmp_path / "export")]
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert r.stdout.splitlines()[-1] == "[2, 0, 0, 2, 2] False False", r.stdout[-2000:] + r.stderr[-2000:]
    assert "unknown config key 'model.dropout'" in r.stderr
    assert "export has no config.json: not a Hugging Face model folder; its revisions step_1 are read" in r.stderr
    assert "revision 'step_2' does not exist in " in r.stderr and "(available: step_1)" in r.stderr
    assert (study / "report" / "index.html").is_file() and (study.parent / "VERDICTS.md").is_file()


def test_a_reading_command_on_no_folder_refuses_before_numpy(tmp_path):
    """`qkgeom analyze /no/such` (or report, verdicts, or a file in place of the folder) said so after 1.4-1.9 s
    of pandas, scipy and matplotlib. The folder is checked first: the same line, and no numerical library
    imported (checked structurally, in one process, not timed)."""
    afile = tmp_path / "notes.txt"
    afile.write_text("not a folder")
    code = (
        "import sys; from qkgeom.cli import main; "
        "rcs = [main(['analyze', sys.argv[1]]), main(['report', sys.argv[1]]), main(['verdicts', sys.argv[2]])]; "
        "print(rcs, [m for m in ('numpy', 'pandas', 'scipy', 'matplotlib') if m in sys.modules])"
    )
    argv = [str(tmp_path / "no-such"), str(afile)]
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert r.stdout.splitlines()[-1] == "[2, 2, 2] []", r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.splitlines() == [
        f"qkgeom analyze: error: {tmp_path / 'no-such'} is not a folder",
        f"qkgeom report: error: {tmp_path / 'no-such'} is not a folder",
        f"qkgeom verdicts: error: {afile} is not a folder",
    ]
    assert afile.read_text() == "not a folder" and not (tmp_path / "no-such").exists()


def test_train_ends_with_where_it_got_and_what_to_run_next(tmp_path, wikitext):
    """`qkgeom train` ended with the folder only. Now: the final validation loss against the unigram
    baseline (both written into done.json, with tokens and parameters) and the next command."""
    import json

    from qkgeom.analysis.context import n_parameters, unigram_baseline

    r = qk("train", "tiny", "--no-progress", "--set", "train.steps=10", "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    done = json.loads((tmp_path / "r" / "done.json").read_text())
    info = json.loads((tmp_path / "r" / "config.json").read_text())
    vocab = (tmp_path / "r" / "vocab.json").read_text()
    assert done["unigram_baseline"] == unigram_baseline("wikitext-2", "char", vocab)  # the analysis' own value
    assert done["n_parameters"] == n_parameters(info["config"]["model"], done["vocab_size"])
    assert done["tokens_seen"] == 10 * 8 * 32
    lines = r.stdout.strip().splitlines()
    assert f"{done['final_valid_loss']:.3f} nats/token, not yet below the unigram baseline" in lines[-2]
    assert lines[-1].strip().startswith(f"next: qkgeom report {tmp_path / 'r'}")
