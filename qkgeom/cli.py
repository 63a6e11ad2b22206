"""Command line: argv -> one library call. Errors print one line and exit non-zero."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qkgeom import config as C

EXAMPLES = """examples:
  qkgeom train tiny                                  train the tiny preset into runs/train/<run-id>
  qkgeom train configs/cpu.toml --set model.n_layers=6 --set train.seed=1
  qkgeom train tiny --out runs/x --resume            continue a killed run from its last checkpoint
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a TOML file or a preset name from configs/ (tiny, cpu, paper, ...)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.lr=3e-4 (repeatable; values parsed as TOML)",
    )


def cmd_train(args: argparse.Namespace) -> int:
    from qkgeom.train import run_id, train

    cfg = C.load(args.config, args.overrides)
    out = Path(args.out) if args.out else Path(args.runs) / "train" / run_id(cfg)
    rd = train(cfg, out, resume=args.resume, progress=not args.no_progress)
    print(f"run complete: {rd.path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkgeom",
        description="Measure and causally steer the geometry of queries and keys in Transformer attention.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train one run (probing Q/K geometry along the way)",
        description="Train one GPT run: AdamW, warm-up + cosine, validation, log-spaced probes, "
        "checkpoints. Writes a self-describing run folder.",
    )
    _add_config_args(p)
    p.add_argument("--out", help="run folder (default: RUNS/train/<run-id>)")
    p.add_argument("--runs", default="runs", help="root folder of runs (default: runs)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from qkgeom.data import DataError
    from qkgeom.results import CheckpointError
    from qkgeom.train import TrainingError

    try:
        return args.fn(args)
    except (C.ConfigError, DataError, CheckpointError, TrainingError, ValueError, FileNotFoundError) as e:
        print(f"qkgeom {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkgeom {args.command}: interrupted (finished files are kept; use --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
