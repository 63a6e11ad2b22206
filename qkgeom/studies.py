"""A study from the command line: its presets described for --help (generated from configs/), and
its sittings: the sweep (sweep_study), and for a study that accumulates across sessions its records
settled before it trains (settle_records), written as each run finishes (record_writer) and counted
with the time left (records_eta)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qkgeom import config as C


def describe_study(path: Path) -> str:
    """One line about a study file, generated from it (so --help always agrees with configs/):
    its run count, base preset, fixed settings, and what its grid varies (seeds, arms, values)."""
    import math
    import tomllib

    spec = tomllib.loads(path.read_text())
    grid, fixed = spec.get("grid", {}), spec.get("set", {})
    parts = []
    for key, values in grid.items():
        if "intervention.kind" in key:
            names = key.split(",")
            arms = [dict(zip(names, v, strict=True)) for v in values]
            labels = [a["intervention.kind"] if a["intervention.kind"] in ("none", "hold") else
                      f"{a['intervention.kind']} {a.get('intervention.on', 'key')} {a.get('intervention.ratio', 1):g}"
                      for a in arms]  # fmt: skip
            parts.append(f"{len(values)} arms ({', '.join(labels)})")
        elif "seed" in key:
            parts.append(f"{len(values)} seeds")
        elif "," in key:  # keys varied together: one setting per value tuple
            sets = ", ".join("/".join(map(str, v)) for v in values)
            parts.append(f"{len(values)} settings of {'/'.join(k.split('.')[-1] for k in key.split(','))} ({sets})")
        else:
            parts.append(f"{key.split('.')[-1]} in {values}")
    n_runs = math.prod(len(v) for v in grid.values())

    def shown(v):  # a long list (kept checkpoint steps) as its ends and length
        return f"[{v[0]}, {v[1]}, ..., {v[-1]}] ({len(v)})" if isinstance(v, list) and len(v) > 6 else v

    settings = ", ".join(
        f"{k.split('.')[-1]}={shown(v)}" for k, v in fixed.items() if not k.startswith("intervention.")
    )
    kept = fixed.get("train.checkpoint_steps", [])
    family = len(kept) >= C.MIN_FAMILY_REVISIONS or fixed.get("train.keep_checkpoints") == "log"
    return (
        f"{n_runs} runs on the {spec['sweep'].get('base', '?')} preset: {' x '.join(parts)}"
        + (f"; {settings}" if settings else "")
        + ("; each run then read as a checkpoint family" if family else "")
    )


def studies_help() -> str:
    """The study presets, one generated line each (describe_study): `qkgeom study --help`'s epilog."""
    lines = ["study presets (generated from configs/study-*.toml):"]
    for f in sorted(C.CONFIG_DIR.glob("study-*.toml")):
        lines.append(f"  {f.stem.removeprefix('study-'):<20} {describe_study(f)}")
    return "\n".join(lines)


def sweep_study(args: argparse.Namespace) -> tuple:
    """A sweep or study from its command-line arguments: (spec, output folder, SweepResult), the result
    None for --dry-run (which lists the runs, recorded / done / to do, and the time left). A study with
    records settles them first, skips the recorded runs and records each run as it finishes."""
    from qkgeom.analysis import ladder, robustness
    from qkgeom.results import RunDir
    from qkgeom.training.grid import SweepError, expand, load_sweep
    from qkgeom.training.sweep import check_pool, run_sweep

    check_pool(args.workers, args.gpus_per_run)
    spec = load_sweep(args.sweep, args.overrides)
    # a misspelt robustness variant is refused now, not by the analysis after every run has trained
    robustness.registered(spec.analysis, dict.fromkeys([*robustness.MAIN_VARIANTS, *ladder.VARIANTS]))
    out = Path(args.out) if args.out else Path(args.runs) / spec.name
    records = records_dir(spec)
    recorded = _recorded(records)
    if args.dry_run:
        runs = expand(spec)
        print(f"{len(runs)} runs -> {out}" + (f" (records: {records})" if records else ""))
        for r in runs:
            state = "recorded" if r.run_id in recorded else "done" if RunDir(out / r.run_id).is_done() else "todo"
            print(f"  [{state}] {r.run_id}  " + " ".join(f"{k}={v}" for k, v in r.overrides.items()))
        if records:
            print(records_eta(runs, recorded, records))
        return spec, out, None
    if records is not None:  # an accumulating study: first settle what earlier sittings left
        settle_records(spec, out, records)
        recorded = _recorded(records)
    res = run_sweep(
        spec, out, workers=args.workers, progress=not args.no_progress, executor=args.executor,
        address=args.address, gpus_per_run=args.gpus_per_run, skip=recorded, on_done=record_writer(out, records),
    )  # fmt: skip
    print(
        f"sweep {spec.name}: {len(res.done)} trained, {len(res.skipped)} already done, "
        f"{len(res.failed)} failed in {res.seconds:.0f} s -> {out}"
    )
    if res.failed and not res.done and not res.skipped:  # nothing to analyse: one line, the cause in it
        errors = sorted(set(res.failed.values()))
        more = f" (and {len(errors) - 1} other errors)" if len(errors) > 1 else ""
        raise SweepError(f"all {len(res.failed)} runs failed: {errors[0]}{more}; what they wrote is kept in {out}")
    for rid, err in res.failed.items():
        print(f"  FAILED {rid}: {err}", file=sys.stderr)
    return spec, out, res


def asks_portable(args: argparse.Namespace) -> bool:
    """Whether the runs of a train, sweep or study command ask for train.portable (--portable or their config)."""
    from qkgeom.training.grid import expand, load_sweep

    if args.command == "train":
        return C.load(args.config, args.overrides).train.portable
    return not args.dry_run and any(r.config.train.portable for r in expand(load_sweep(args.sweep, args.overrides)))


def records_dir(spec) -> Path | None:
    """Where a study that accumulates across sessions keeps its records ([analysis] records: in the
    checkout, or under the current directory where qkgeom is installed from a wheel)."""
    rel = spec.analysis.get("records")
    return C.project_path(rel) if rel else None


def _recorded(records: Path | None) -> set[str]:
    if records is None:
        return set()
    from qkgeom.analysis.records import recorded_runs

    return recorded_runs(records)


def settle_records(spec, out: Path, records: Path) -> None:
    """Before an accumulating study trains: its manifest in the records folder (the [analysis] every
    record is stamped with), a killed record write's temp folder removed, the records checked against
    the pre-registration, and a record written for every run that finished without one."""
    from qkgeom.analysis.prereg import check_records
    from qkgeom.analysis.records import clean_temp, record_missing, restore_baselines
    from qkgeom.training.grid import expand, write_manifest

    runs = expand(spec)
    check_records(records, spec.analysis)  # every check first: a refused sitting changes nothing
    records.mkdir(parents=True, exist_ok=True)
    write_manifest(spec, runs, records)
    for d in clean_temp(records):
        print(f"removed {d} (a record write that was killed)", file=sys.stderr)
    from qkgeom.families.study import record_run

    for d in record_missing(out, records, [r.run_id for r in runs], write=record_run):
        print(f"recorded {d.name} (finished earlier without its record)", file=sys.stderr)
    needs = {r.run_id: Path(r.config.intervention.baseline).name for r in runs if r.config.intervention.baseline}
    for d in restore_baselines(out, records, needs):
        print(f"restored {d.name} from its record (the baseline of runs still to train)", file=sys.stderr)


def record_writer(out: Path, records: Path | None):
    """on_done for a study with records: each finished run's record at once (a family study's run with its
    family measured first: families.study.record_run), then commit it."""
    if records is None:
        return None
    from qkgeom.families.study import record_run

    return lambda run_id: record_run(out / run_id, records)


def records_eta(runs, recorded: set[str], records: Path) -> str:
    """done / to do / estimated time, from the step times measured in the recorded runs."""
    from qkgeom.analysis.records import measured_seconds

    per_step = measured_seconds(records)  # seconds per step, by (n_layers, batch tokens)
    todo = [r for r in runs if r.run_id not in recorded]
    known = [per_step.get((r.config.model.n_layers, r.config.train.batch_size * r.config.model.n_ctx)) for r in todo]
    eta = sum(k * r.config.train.steps for k, r in zip(known, todo, strict=True) if k)
    unknown = sum(k is None for k in known)
    head = f"recorded {len(recorded)} / {len(runs)}; to do {len(todo)} runs"
    if not todo:
        return head
    if unknown == len(todo):  # a first sitting: nothing recorded at these shapes to time them by
        return f"{head}; no time estimate until a run of their shapes is recorded (its step times measure it)"
    return (
        f"{head}, ~{eta / 3600:.1f} h of one worker at the measured step times"
        + (f" (+{unknown} runs of an unmeasured shape)" if unknown else "")
        + "; two workers on two cores take about half that"
    )
