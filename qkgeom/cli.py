"""Command line: argv -> one library call. Errors print one line and exit non-zero."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qkgeom import config as C
from qkgeom import device as D
from qkgeom.commands import (
    cmd_amend,
    cmd_analyze,
    cmd_export,
    cmd_pretrained,
    cmd_report,
    cmd_study,
    cmd_sweep,
    cmd_train,
    cmd_verdicts,
)
from qkgeom.studies import asks_portable, studies_help

EXAMPLES = """examples:
  qkgeom train tiny                                  train the tiny preset into runs/train/<run-id>
  qkgeom train configs/cpu.toml --set model.n_layers=6 --set train.seed=1
  qkgeom train tiny --out runs/x --resume            continue a killed run from its last checkpoint
  qkgeom sweep smoke --dry-run                       list the 36 runs of the smoke study
  qkgeom study smoke                                 the main study end to end at tiny width (minutes)
  qkgeom study causal-cpu                            the pre-registered causal test (qkgeom study --help: all studies)
  qkgeom analyze runs/study-smoke                    print and save the claims table
  qkgeom report runs/study-smoke                     runs/study-smoke/report/index.html
  qkgeom pretrained EleutherAI/pythia-70m --family pythia --every 10
  qkgeom export runs/train/<run-id> --out runs/hf/mine && qkgeom pretrained runs/hf/mine --all-revisions
"""


def _add_output_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--out", help=f"output folder (default: {default})")
    p.add_argument("--runs", default="runs", help="root folder of runs (default: runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_set_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def _add_portable_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--portable",
        action="store_true",
        help="one float code path whatever the CPU, so runs repeat bit for bit on another x86-64 CPU, Intel or "
        "AMD (slower; = --set train.portable=true; qkgeom restarts under qkgeom.device.PORTABLE_ENV)",
    )


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help=f"a TOML file or a preset name (tiny, smoke, cpu, paper: {C.CONFIG_DIR}/<name>.toml)")
    _add_set_arg(p, "override a config field, e.g. --set train.lr=3e-4 (repeatable; values parsed as TOML)")
    _add_portable_arg(p)


def _add_executor_args(p: argparse.ArgumentParser, what: str) -> None:
    """--executor and --address: where the jobs of a sweep, study or family run (qkgeom.executor)."""
    p.add_argument("--executor", choices=["local", "ray"], default="local", help=what)
    p.add_argument("--address", help="Ray cluster address (default: start or join a local instance)")


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", help="a sweep TOML file or a study preset (listed below under `study --help`)")
    _add_set_arg(p, "override a config field in every run, e.g. --set train.steps=50 (repeatable)")
    _add_portable_arg(p)
    _add_output_args(p, "RUNS/<sweep name>")
    workers = (
        "parallel runs (default: one per CPU core, or one per visible GPU for runs on cuda; each gets "
        "cores/workers torch threads; runs on plain `cuda` are spread over the visible GPUs, one per worker, "
        "round robin)"
    )
    p.add_argument("--workers", type=int, default=0, help=workers)
    _add_executor_args(p, "local process pool (default) or a Ray cluster (pip install qkgeom[ray])")
    p.add_argument("--gpus-per-run", type=float, default=0.0, help="with --executor ray: GPUs each run asks for")
    p.add_argument("--dry-run", action="store_true", help="list the runs (and which are done) without running")


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("qkgeom")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one sub-command per job, help on every flag."""
    parser = argparse.ArgumentParser(
        prog="qkgeom",
        description="Measure and causally steer the geometry of queries and keys in Transformer attention.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    parser.add_argument("--version", action="version", version=f"qkgeom {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train one run (probing Q/K geometry along the way)",
        description="Train one GPT run: AdamW, warm-up + cosine, validation, log-spaced probes, "
        "checkpoints. Writes a self-describing run folder.",
    )
    _add_config_args(p)
    _add_output_args(p, "RUNS/train/<run-id>")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also log each probe's layer-mean PR_Q, PR_K, contrast, entropy and interaction rank as "
        "TensorBoard scalars qkgeom/<metric> in DIR (pip install 'qkgeom[tensorboard]')",
    )
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser(
        "sweep",
        help="run a grid of training runs (a local worker pool, or Ray with --executor ray)",
        description="Expand a sweep file's grid into deterministic runs, write sweep.json, and train "
        "every unfinished run in parallel. Finished runs are skipped; partial ones resume; "
        "a failing run is recorded (error.json) without stopping the others.",
    )
    _add_sweep_args(p)
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser(
        "analyze",
        help="claims table and seed-averaged trajectories of a folder of runs",
        description="Load every finished run under DIR (unfinished or corrupt ones are skipped with a "
        "warning), write summary, claims, sensitivity and seed_agreement tables (.parquet and .csv) and "
        "print the verdicts. The post-transient window starts at each run's detected transient end "
        "(docs/GLOSSARY.md, 'Windows'); the sensitivity table repeats every claim from fixed starts.",
    )
    p.add_argument("dir", help="a sweep folder, a folder of runs, or one run folder")
    p.set_defaults(fn=cmd_analyze)

    p = sub.add_parser(
        "report",
        help="self-contained HTML report with figures",
        description="Analyse DIR and write DIR/report/index.html (figures embedded) and the PNGs.",
    )
    p.add_argument("dir", help="a sweep folder, a folder of runs, or one run folder")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser(
        "verdicts",
        help="every pre-registered primary row of every committed study, with raw and Holm p",
        description="Read DIR/*/claims.csv (committed studies) and each study's primary family ([analysis] "
        "primary in configs/study-<name>.toml or DIR/<study>/preregistration.toml); write DIR/VERDICTS.md.",
    )
    p.add_argument("dir", nargs="?", default="docs/results", help="the committed results (default docs/results)")
    p.set_defaults(fn=cmd_verdicts)

    p = sub.add_parser(
        "amend",
        help="register a changed pre-registration of a study with records as a new version",
        description="Every record carries the digest of the pre-registration (study file, preregistration.toml, "
        "[analysis]) it was judged under, and analyze, study and verdicts refuse a folder whose pre-registration "
        "changed since. An amendment made on purpose is registered here: DIR/preregistration_versions.json keeps "
        "the old and the new digest with your note, and VERDICTS.md lists both versions.",
    )
    p.add_argument("dir", help="a committed study folder with records (docs/results/<study>)")
    p.add_argument("--note", required=True, help="what changed and why (kept with the new version)")
    p.add_argument(
        "--sweep",
        help="the sweep file whose edited [analysis] is registered (default: configs/study-<name>.toml)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="instead: pin a study without records (its verdicts cannot be re-derived) by the digests of its "
        "pre-registration and its committed claims.csv; verdicts refuses either changed",
    )
    p.add_argument(
        "--seal",
        action="store_true",
        help="instead: seal the records that have no seal.json yet (written before seals) by their data; "
        "sealed records are refused once any byte of them changes",
    )
    p.set_defaults(fn=cmd_amend)

    p = sub.add_parser(
        "study",
        help="sweep -> analyze -> report in one command",
        description="Run a study preset or sweep file end to end (sweep -> analyze -> report); it ends with the "
        "verdict table and the report's path.",
        epilog=studies_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_sweep_args(p)
    p.set_defaults(fn=cmd_study)

    p = sub.add_parser(
        "pretrained",
        help="token-level Q/K geometry of a Hugging Face model or checkpoint family",
        description="Stream a text sample through a Hugging Face model (hub name + revision, or a local "
        "folder) and record per layer and head PR_Q, PR_K, their contrast, attention "
        "entropy and the W_Q W_K^T spectrum (pre- and post-rotary where rotary applies). "
        "Several revisions form a checkpoint family: processed one at a time with resume, "
        "weights hashed, duplicates flagged, trend statistics and a report written.",
    )
    p.add_argument(
        "model", help="hub name (EleutherAI/pythia-70m) or local folder (also one with a folder per revision)"
    )
    p.add_argument(
        "--config", help="a TOML file with a [pretrained] table (fields of qkgeom.families.config.PretrainedConfig)"
    )
    _add_set_arg(p, "override a field, e.g. --set logit_max_seqs=16 (repeatable; the flags below are shortcuts)")
    p.add_argument("--revision", action="append", default=[], help="revision (repeatable), e.g. step1000")
    p.add_argument("--family", choices=["pythia"], help="add a built-in revision schedule")
    p.add_argument(
        "--every",
        type=int,
        help="with --family: keep every k-th of the linear part; with --all-revisions: every k-th past "
        "--early-max-step, and the last (default 1)",
    )
    p.add_argument(
        "--all-revisions",
        action="store_true",
        default=None,
        help="every revision sub-folder of a local model folder, or every branch of a hub model named by a "
        "training step (step1000, step20000-tokens84B; of its first training stage), in step order",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list the revisions (and which are done) without loading a model"
    )
    p.add_argument("--text", help="text file to sample (default: WikiText-2 validation, raw where available)")
    p.add_argument(
        "--tokenizer",
        help="tokenizer name or folder (default: the model's own; an exported qkgeom run "
        "has its own vocabulary and takes none)",
    )
    p.add_argument("--n-tokens", type=int, help="tokens to stream (default 65536)")
    p.add_argument("--seq-len", type=int, help="sequence length (default 256; capped at the model's context)")
    p.add_argument("--batch-size", type=int, help="sequences per forward pass (default 8)")
    p.add_argument(
        "--strip-special-tokens",
        action="store_true",
        default=None,
        help="do not open each sequence with the model's own start tokens (BOS/CLS; by default they are "
        "used as in training, and recorded as start_tokens in each revision's config.json)",
    )
    p.add_argument("--early-max-step", type=int, help="last step of the early window (default 1000)")
    p.add_argument(
        "--device", help="torch device to run the model on: cpu (default), cuda, cuda:N (not mps: it has no float64)"
    )
    _add_output_args(p, "RUNS/pretrained/<model>")
    _add_executor_args(p, "revisions one after another (default) or in parallel as Ray tasks")
    p.set_defaults(fn=cmd_pretrained)

    p = sub.add_parser(
        "export",
        help="write a run's checkpoints as Hugging Face GPT-2 folders",
        description="Export every checkpoint of a qkgeom run as OUT/step_<n>/ (GPT-2 config + "
        "safetensors + our vocabulary), so `qkgeom pretrained OUT --all-revisions` "
        "analyses the run as a checkpoint family.",
    )
    p.add_argument("run", help="a run folder")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(fn=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes: 0 done, 2 bad input or a refused operation (one line on stderr,
    QKGeomError, an OS error such as a full disk, memory refused), 130 interrupted, 1 a bug (traceback)."""
    import os

    if os.name == "nt":  # no SIGPIPE, no flock: README, "Where it runs"
        print("qkgeom: error: qkgeom runs on Linux and macOS; on Windows, run it under WSL", file=sys.stderr)
        return 2
    return _run(argv)


def _run(argv: list[str] | None) -> int:
    """main() on a POSIX system."""
    import os
    import signal
    import traceback

    from qkgeom.errors import QKGeomError, out_of_memory

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `qkgeom sweep smoke --dry-run | head` ends quietly
    args = build_parser().parse_args(argv)
    debug = os.environ.get("QKGEOM_DEBUG", "") not in ("", "0")

    def refused(message: str) -> int:  # one line, exit 2; QKGEOM_DEBUG=1 adds the traceback
        if debug:
            traceback.print_exc()
        print(f"qkgeom {args.command}: error: {message}", file=sys.stderr)
        return 2

    try:
        if getattr(args, "portable", False):
            args.overrides.append("train.portable=true")
        _refuse_unusable_options(args)
        if hasattr(args, "portable") and D.portable_env_missing() and asks_portable(args):
            return D.rerun_portable(sys.argv[1:] if argv is None else argv, replace=argv is None)
        return args.fn(args)
    except KeyboardInterrupt:
        print(f"qkgeom {args.command}: interrupted (finished files are kept; {_resume_hint(args)})", file=sys.stderr)
        return 130
    except OSError as e:  # unwritable or full disk, --out on a file, ...: finished files are kept
        where = f": {e.filename}" if e.filename else ""
        again = _resume_hint(args, "run the command again")
        return refused(f"{e.strerror or e}{where} (finished files are kept; fix it, then {again})")
    except QKGeomError as e:
        return refused(str(e))
    except Exception as e:
        if (why := out_of_memory(e)) is not None:  # a setting to lower, not a bug
            return refused(f"{why} (finished files are kept)")
        traceback.print_exc()
        print(f"qkgeom {args.command}: this is a bug in qkgeom, not in your input; please report it with the "
              "traceback above", file=sys.stderr)  # fmt: skip
        return 1


def _refuse_unusable_options(args: argparse.Namespace) -> None:
    """Options that would be dropped or fail late: --address or --gpus-per-run without --executor ray (the
    jobs would run in the local pool, silently); an --out that names a file ("File exists", after the imports)."""
    from qkgeom.errors import QKGeomError

    if getattr(args, "executor", "ray") != "ray" and (args.address or getattr(args, "gpus_per_run", 0)):
        raise QKGeomError("--address and --gpus-per-run are Ray's: add --executor ray (the local pool has neither)")
    if getattr(args, "out", None) and Path(args.out).exists() and not Path(args.out).is_dir():
        raise QKGeomError(f"--out {args.out} is a file, not a folder")


def _resume_hint(args: argparse.Namespace, otherwise: str = "run the same command again") -> str:
    """`use --resume` only for the commands that have it, where --out is a folder; sweeps and studies skip
    finished runs."""
    return "use --resume" if hasattr(args, "resume") and (not args.out or Path(args.out).is_dir()) else otherwise


if __name__ == "__main__":
    sys.exit(main())
