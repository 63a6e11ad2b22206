"""Compact study records: what a committed study keeps of each run, so that its verdicts can be
re-derived and re-analysed after the run folders are gone (they are not kept between sessions).

A record is a slim run folder under ``docs/results/<study>/runs/<run_id>/`` (results.RECORDS_DIR):

    config.json       the resolved config + provenance (code commit, dirty flag, versions) as the run
                      wrote it, plus ``record``: the corpus sha256 and what was thinned
    geometry.parquet  every probe's rows (step, tokens_seen, layer, head, site, metric, value), zstd
    metrics.jsonl     every validation row; training rows thinned to at most RECORD_TRAIN_ROWS
    vocab.json, done.json
    family/<rev>/     a family study's run: each kept checkpoint's measurement (config.json, geometry.parquet,
                      done.json of its `qkgeom pretrained` folder), so the family re-derives without weights
    seal.json         the sha256 of each file above and the run id (analysis.prereg: checked on every read)

``record.preregistration`` in config.json is the digest of the pre-registration the record was
judged under (analysis.prereg): a later edit of it is refused unless registered as a new version.

Spectra and checkpoints are dropped (they are what makes a run folder 10 MB). Because a record is a
run folder, every reader (load_runs, analyze, report) reads it unchanged: ``qkgeom analyze
docs/results/<study>`` finds the records under runs/ and rewrites claims.csv and verdicts.csv
byte-identical (tests/analysis/test_records.py).
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from qkgeom.analysis.prereg import digest, record_folders, write_seal
from qkgeom.results import FAMILY_RECORD, RECORDS_DIR, RunDir, atomic_write_bytes, read_json, write_json
from qkgeom.training.data import file_digest, resolve_source

RECORD_TRAIN_ROWS = 200  # training-loss rows kept per run: a loss curve, not every step
FAMILY_FILES = ("config.json", "geometry.parquet", "done.json")  # what a revision keeps (no spectra)


def _thin_metrics(rows: list[dict]) -> list[dict]:
    train = [r for r in rows if r.get("split") == "train"]
    every = max(1, -(-len(train) // RECORD_TRAIN_ROWS))
    last = train[-1]["step"] if train else None
    return [
        r for r in rows
        if r.get("split") != "train" or r["step"] % every == 0 or r["step"] == last
    ]  # fmt: skip


def corpus_digest(config: dict) -> str | None:
    """sha256 over the corpus' train/valid/test files, or None where the corpus is not on this machine."""
    try:
        root = resolve_source(config["data"]["source"])
    except Exception:  # noqa: BLE001 - a record of a run whose corpus is elsewhere still gets written
        return None
    parts = [
        file_digest(root / f"{split}.txt") for split in ("train", "valid", "test") if (root / f"{split}.txt").is_file()
    ]
    return "sha256:" + "|".join(parts) if parts else None


def write_record(run: str | Path, dest: str | Path, family: str | Path | None = None) -> Path:
    """The record of a finished run under `dest`/<run_id>/ (replaced whole if present), stamped with
    the digest of the pre-registration of the study folder `dest` lies in. family: the run's family
    measurement (a `qkgeom pretrained` folder of its kept checkpoints), kept as family/<revision>/
    (every finished revision; spectra dropped). Returns it."""
    rd = RunDir(run)
    if not rd.is_done():
        raise FileNotFoundError(f"{rd.path} is not a finished run (no done.json): no record written")
    out = RunDir(Path(dest) / rd.path.name)
    tmp = RunDir(Path(dest) / f".{rd.path.name}.tmp")
    shutil.rmtree(tmp.path, ignore_errors=True)
    tmp.path.mkdir(parents=True)
    info = read_json(rd.config)
    rows = rd.read_metrics()
    kept = _thin_metrics(rows)
    info["record"] = {
        "data_sha256": corpus_digest(info.get("config", {})),
        "metrics_rows": {"kept": len(kept), "of": len(rows), "train_rows_at_most": RECORD_TRAIN_ROWS},
        "dropped": ["spectra.npz", "checkpoints/"] + ([f"{FAMILY_RECORD}/*/spectra.npz"] if family else []),
        "preregistration": digest(Path(dest).parent),
    }
    write_json(tmp.config, info)
    buf = io.BytesIO()
    pd.read_parquet(rd.geometry).to_parquet(buf, index=False, compression="zstd")
    atomic_write_bytes(tmp.geometry, buf.getvalue())
    atomic_write_bytes(tmp.metrics, "".join(json.dumps(r) + "\n" for r in kept).encode())
    if rd.vocab.is_file():
        shutil.copyfile(rd.vocab, tmp.vocab)
    if family is not None:
        for rev in sorted(d for d in Path(family).iterdir() if RunDir(d).is_done() and not d.name.startswith(".")):
            (tmp.path / FAMILY_RECORD / rev.name).mkdir(parents=True)
            for name in FAMILY_FILES:
                shutil.copyfile(rev / name, tmp.path / FAMILY_RECORD / rev.name / name)
    shutil.copyfile(rd.done, tmp.done)  # a record with done.json is whole
    write_seal(tmp.path, rd.path.name)  # sealed by its data, under the name the folder takes next
    if out.path.exists():
        shutil.rmtree(out.path)
    tmp.path.rename(out.path)
    return out.path


def clean_temp(results: str | Path) -> list[Path]:
    """Remove the hidden temp folders a killed write_record left under `results`/runs/. Returns them."""
    dest = Path(results) / RECORDS_DIR
    stale = sorted(d for d in dest.glob(".*.tmp") if d.is_dir()) if dest.is_dir() else []
    for d in stale:
        shutil.rmtree(d)
    return stale


def record_missing(
    runs: str | Path, results: str | Path, run_ids: list[str], write: Callable[[Path, Path], Path] | None = None
) -> list[Path]:
    """A record under `results`/runs/ for every finished run of `run_ids` under `runs` that has none
    (a study killed between a run's done.json and its record's write). write(run, results): the writer a
    sitting records finished runs with (default write_record). Returns the records written."""
    write = write or (lambda run, res: write_record(run, Path(res) / RECORDS_DIR))
    have = recorded_runs(results)
    return [write(Path(runs) / r, Path(results)) for r in run_ids if r not in have and RunDir(Path(runs) / r).is_done()]


def recorded_runs(results: str | Path) -> set[str]:
    """The run ids whose records are in `results`/runs/ (a study skips them)."""
    return {d.name for d in record_folders(results) if (d / "done.json").is_file()}


def measured_seconds(results: str | Path) -> dict[tuple[int, int], float]:
    """Seconds per training step measured in the recorded runs (done.json elapsed / steps), by
    (n_layers, tokens per step): what `qkgeom study --dry-run` estimates the rest from."""
    seen: dict[tuple[int, int], list[float]] = {}
    for d in record_folders(results):
        rd = RunDir(d)
        if not rd.is_done():
            continue
        info, done = read_json(rd.config), read_json(rd.done)
        m, t = info["config"]["model"], info["config"]["train"]
        if done.get("elapsed") and done.get("step"):
            seen.setdefault((m["n_layers"], t["batch_size"] * m["n_ctx"]), []).append(done["elapsed"] / done["step"])
    return {k: sum(v) / len(v) for k, v in seen.items()}


def restore_baselines(runs: str | Path, results: str | Path, needs: dict[str, str]) -> list[Path]:
    """The baseline (`none`) runs that runs still to train read their targets from, restored from their
    records where the run folder is gone (run folders are not kept between sittings; a record holds the
    geometry and done.json the control reads). needs: run id -> its baseline's run id; a run already
    recorded needs nothing. Returns the folders restored; a finished folder is kept."""
    restored, have = [], recorded_runs(results)
    for run_id in sorted({base for run, base in needs.items() if run not in have}):
        folder, record = Path(runs) / run_id, Path(results) / RECORDS_DIR / run_id
        if RunDir(folder).is_done() or not (record / "done.json").is_file():
            continue
        tmp = folder.with_name(f".{run_id}.restoring")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(record, tmp)  # whole, then renamed: a killed copy never looks finished
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        restored.append(folder)
    return restored
