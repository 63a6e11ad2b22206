"""A sweep file read: its tables checked, its grid expanded into deterministic runs, the manifest.

A sweep file is TOML with three tables::

    [sweep]   name = "study-smoke"; base = "smoke"   (a run preset or TOML file)
              order = "cost" (default: longest runs first) | "seed" (whole seeds first, longest first
              within a seed, so that a study run in several sittings completes whole seeds)
    [set]     fixed overrides, e.g. "train.steps" = 100
    [grid]    "model.n_layers" = [4, 6, 8]; "train.seed,train.data_seed" = [[0, 0], [1, 1]]  (zipped keys)
    [analysis] (optional, a pre-registration's machine-readable part) primary = [{id = "P1", claim = "PR_K
              shrinks", group = "all", window = "post-transient"}, ...]: the primary family, Holm-adjusted
              together (analysis.primary.adjust_primary); margin = 0.1: the equivalence margin of TOST;
              records = "docs/results/<study>": a study that accumulates across sessions (its committed
              per-run records are skipped, each finished run's record written at once; analysis.records)

Every value is checked when the file is read, before anything runs; training.sweep runs the result.
"""

from __future__ import annotations

import itertools
import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkgeom import config as C
from qkgeom.errors import QKGeomError, read_text
from qkgeom.results import SWEEP_MANIFEST, write_json


class SweepError(QKGeomError, ValueError):
    """A sweep file or grid that cannot be expanded."""


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: str
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list] = field(default_factory=dict)
    order: str = "cost"
    analysis: dict[str, Any] = field(default_factory=dict)


SWEEP_ORDERS = ("cost", "seed")


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    overrides: dict[str, Any]
    config: C.RunConfig


def _is_primary(s: object) -> bool:
    keys = {"id", "claim_id", "group", "window"}
    return isinstance(s, dict) and {"id", "claim_id"} <= set(s) <= keys and all(isinstance(v, str) for v in s.values())


# what a study file's [analysis] may hold: its primary family, TOST margin, records folder and the
# robustness variants its primaries are re-judged under (analysis.robustness); each value's type is
# checked when the file is read, not by the analysis after the sweep has run
ANALYSIS_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "primary": (
        "a list of tables {id, claim_id, group, window} of strings (group and window optional), ids unique",
        lambda v: isinstance(v, list) and all(map(_is_primary, v)) and len({x["id"] for x in v}) == len(v),
    ),
    "margin": ("a positive number", lambda v: type(v) in (int, float) and 0 < v < float("inf")),
    "records": ("a folder (a string)", lambda v: isinstance(v, str)),
    "robustness": ("a list of variant names", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
}
ANALYSIS_KEYS = tuple(ANALYSIS_TYPES)


def resolve_sweep(path: str | Path) -> Path:
    """A sweep TOML path, or a study preset name (`smoke` -> configs/study-smoke.toml)."""
    p = Path(path)
    if p.is_file():
        return p
    for cand in (C.CONFIG_DIR / f"study-{path}.toml", C.CONFIG_DIR / f"{path}.toml"):
        if cand.is_file():
            return cand
    known = ", ".join(sorted(x.stem.removeprefix("study-") for x in C.CONFIG_DIR.glob("study-*.toml")))
    raise SweepError(f"sweep {str(path)!r} is neither a file nor a study preset (presets: {known})")


def _check_tables(data: dict, p: Path) -> None:
    """A sweep file's tables and the keys of [sweep] and [analysis] (with each [analysis] value's type)."""
    unknown = sorted(set(data) - {"sweep", "set", "grid", "analysis"})
    if unknown or "sweep" not in data:
        raise SweepError(
            f"sweep file {p} needs a [sweep] table and only [sweep], [set], [grid], [analysis] (found {unknown})"
        )
    bad_analysis = sorted(set(data.get("analysis", {})) - set(ANALYSIS_KEYS))
    if bad_analysis:
        known = ", ".join(ANALYSIS_KEYS)
        raise SweepError(f"unknown key {bad_analysis[0]!r} in [analysis] of {p} (known: {known})")
    for key, value in data.get("analysis", {}).items():
        if not ANALYSIS_TYPES[key][1](value):
            raise SweepError(f"[analysis] {key} in {p} must be {ANALYSIS_TYPES[key][0]}, got {value!r}")
    head = data["sweep"]
    if "kind" in head:  # earlier sweep files: the analysis now reads each run's own config instead
        raise SweepError(f"[sweep] kind in {p} is no longer used (analyze reads each run's config); delete the line")
    bad = sorted(set(head) - {"name", "base", "order"})
    if bad:
        raise SweepError(f"unknown key {bad[0]!r} in [sweep] of {p}")
    if head.get("order", "cost") not in SWEEP_ORDERS:
        raise SweepError(f"[sweep] order in {p} is {head['order']!r}; allowed: {', '.join(SWEEP_ORDERS)}")


def load_sweep(path: str | Path, extra: list[str] | None = None) -> SweepSpec:
    """Parse a sweep file; `extra` are ``key=value`` overrides added to its [set] table."""
    p = resolve_sweep(path)
    try:
        data = tomllib.loads(read_text(p, SweepError))
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"sweep file {p} is not valid TOML: {e}") from None
    _check_tables(data, p)
    head = data["sweep"]
    name = head.get("name", p.stem)
    if not isinstance(name, str) or C.safe_name(name) != name:  # its folder is runs/<name>: nothing outside
        raise SweepError(f"[sweep] name {name!r} in {p} must be a plain folder name (letters, digits, . _ = , + -)")
    fixed = dict(data.get("set", {}))
    grid_keys = {k.strip() for key in data.get("grid", {}) for k in key.split(",")}
    if both := sorted(grid_keys & set(fixed)):
        raise SweepError(f"{both[0]!r} is in both [set] and [grid] of {p}: the grid would override [set]")
    for item in extra or []:
        key, _, text = item.partition("=")
        if key.strip() in grid_keys:
            raise SweepError(
                f"--set {key.strip()} names a grid key of {p.name}, which the grid would override; "
                "edit the sweep's [grid] (or copy the file) instead"
            )
        fixed[key.strip()] = C.parse_scalar(text.strip())
    spec = SweepSpec(
        name=name,
        base=head.get("base", "tiny"),
        fixed=fixed,
        grid=dict(data.get("grid", {})),
        order=head.get("order", "cost"),
        analysis=dict(data.get("analysis", {})),
    )
    return spec


def _as_override(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"  # JSON scalars and lists are valid TOML values


def expand(spec: SweepSpec) -> list[RunSpec]:
    """Every combination of the grid (zipped keys move together), validated, with run ids."""
    for key, values in spec.grid.items():
        if not isinstance(values, list):
            raise SweepError(f"grid key {key!r} of sweep {spec.name!r} must be a list of values, got {values!r}")
    if not spec.grid or any(len(v) == 0 for v in spec.grid.values()):
        raise SweepError(f"sweep {spec.name!r} has an empty grid")
    axes = []
    for key, values in spec.grid.items():
        keys = [k.strip() for k in key.split(",")]
        if len(keys) > 1 and not all(isinstance(v, list) and len(v) == len(keys) for v in values):
            raise SweepError(f"grid key {key!r} zips {len(keys)} keys: each value must be a list of {len(keys)}")
        axes.append([dict(zip(keys, v if len(keys) > 1 else [v], strict=True)) for v in values])
    runs = []
    for combo in itertools.product(*axes):
        overrides = {**spec.fixed, **{k: v for part in combo for k, v in part.items()}}
        # a list value is named by its length (its items are in config.json), so names stay short
        label = "_".join(
            f"{k.split('.')[-1]}={len(v) if isinstance(v, list) else v}" for part in combo for k, v in part.items()
        )
        strings = [_as_override(k, v) for k, v in overrides.items()] + [_as_override("name", C.safe_name(label))]
        try:
            cfg = C.load(spec.base, strings)
        except C.ConfigError as e:
            raise SweepError(f"sweep {spec.name!r}: {e}") from None
        runs.append(RunSpec(C.run_id(cfg), overrides, cfg))
    if len({r.run_id for r in runs}) < len(runs):  # two runs would train into one folder
        twice = next(r for r in runs if sum(x.run_id == r.run_id for x in runs) > 1)
        raise SweepError(f"sweep {spec.name!r} holds run {twice.run_id} twice: its grid repeats a value")
    return [_with_baseline(spec, r, runs) for r in runs]


def _with_baseline(spec: SweepSpec, r: RunSpec, runs: list[RunSpec]) -> RunSpec:
    """A contract/expand run relative to its baseline gets intervention.baseline = the run id of the
    `none` run with the same overrides outside [intervention] (same seeds, same model)."""
    if not C.needs_baseline(r.config.intervention) or r.config.intervention.baseline:
        return r

    def outside(x: RunSpec) -> dict:
        return {k: v for k, v in x.overrides.items() if not k.startswith("intervention.")}

    match = [b for b in runs if b.config.intervention.kind == "none" and outside(b) == outside(r)]
    if not match:
        raise SweepError(
            f"sweep {spec.name!r}: run {r.run_id} is relative to its baseline, but the grid has no "
            "intervention.kind = 'none' run with the same other settings"
        )
    overrides = {**r.overrides, "intervention.baseline": match[0].run_id}
    cfg = C.from_dict(C.apply_overrides(C.to_dict(r.config), [_as_override("intervention.baseline", match[0].run_id)]))
    return RunSpec(C.run_id(cfg), overrides, cfg)


def write_manifest(spec: SweepSpec, runs: list[RunSpec], out: Path) -> None:
    """sweep.json: the expanded grid (and the study's [analysis]), written before any run."""
    write_json(
        out / SWEEP_MANIFEST,
        {
            "name": spec.name,
            "base": spec.base,
            "set": spec.fixed,
            "grid": spec.grid,
            "analysis": spec.analysis,
            "runs": [{"run_id": r.run_id, "overrides": r.overrides, "config": C.to_dict(r.config)} for r in runs],
        },
    )
