"""The only module that knows the disk layout of a run folder.

    <run>/config.json        resolved config + provenance (written first)
    <run>/vocab.json         the vocabulary built from the training split
    <run>/metrics.jsonl      one JSON object per line: step, tokens_seen, split, loss, lr, elapsed
    <run>/geometry.parquet   tidy rows: step, tokens_seen, layer, head, site, metric, value, note
    <run>/spectra.npz        per probe: stacked spectra, first axis aligned with `step`
    <run>/checkpoints/       last.pt (resume) and step_<n>.pt (kept); torch weights-only format
    <run>/warnings.jsonl     non-fatal numerical fallbacks of the probe (only if any happened)
    <run>/done.json          written last; its presence means the run is complete
    <run>/error.json         only for a run that failed in a sweep
    <sweep>/sweep.json       the expanded grid of a sweep, written before anything runs

Every write is atomic (temp file + rename), so a killed run never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.errors import QKGeomError

# note: why a value is NaN (e.g. an alpha fit with too few tail eigenvalues), else empty (null)
GEOMETRY_COLUMNS = ["step", "tokens_seen", "layer", "head", "site", "metric", "value", "note"]


def geometry_frame(rows: list[dict[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """Rows as the geometry table: GEOMETRY_COLUMNS, `note` a nullable string (null where empty)."""
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows, columns=GEOMETRY_COLUMNS)
    if "note" not in df:
        df = df.assign(note=None)
    note = df["note"].astype("string")
    return df.assign(note=note.mask(note == ""))


class CheckpointError(QKGeomError, RuntimeError):
    """A checkpoint that is missing, truncated or corrupt."""


class DamagedRunError(QKGeomError, ValueError):
    """A run folder's file is damaged or incomplete; the message names the file."""


class FolderLockedError(QKGeomError, RuntimeError):
    """Another live process holds the folder (a run or a sweep)."""


LOCK_FILE = ".lock"
SWEEP_MANIFEST = "sweep.json"
LAST_CHECKPOINT = "last.pt"  # a run's resume point under checkpoints/
RECORDS_DIR = "runs"  # a committed study's per-run records: docs/results/<study>/runs/<run_id>/
FAMILY_RECORD = "family"  # a family study record's measurements: family/<revision>/ (analysis.records)
REPORT_DIR, REPORT_INDEX = "report", "index.html"  # a study's, run's or family's report folder and page
# a family folder (`qkgeom pretrained`) and a family study's tables
REVISIONS_CSV, TRENDS_CSV = "revisions.csv", "trends.csv"
FAMILY_FACTS = "family_facts.json"  # a family's early window and the revisions left out (families.revisions)
FAMILY_SEEDS_CSV, FAMILY_CLAIMS_CSV = "family_seeds.csv", "family_claims.csv"
FAMILY_PARQUET = "family.parquet"  # one tidy dataset of a family: checkpoint x layer x head x metric


def kept_checkpoint(step: int) -> str:
    """The file name of a checkpoint kept at `step` (beside last.pt)."""
    return f"step_{step}.pt"


def revision_name(step: int) -> str:
    """The folder (revision) of an exported checkpoint of `step`."""
    return f"step_{step}"


def write_table(folder: Path, name: str, df: pd.DataFrame, parquet: bool = False) -> Path:
    """`df` as folder/name.csv (floats to 12 significant digits) and name.parquet if asked, each written
    atomically; returns the CSV's path."""
    if parquet:
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        atomic_write_bytes(Path(folder) / f"{name}.parquet", buf.getvalue())
    # 12 significant digits: a table re-derived on another CPU (another SIMD summation order) is the
    # same file; the parquet copy keeps every bit
    atomic_write_bytes(Path(folder) / f"{name}.csv", df.to_csv(index=False, float_format="%.12g").encode())
    return Path(folder) / f"{name}.csv"


# an exported revision (qkgeom.families.export): its vocabulary, and its provenance (written last)
EXPORT_VOCAB = "qkgeom_vocab.json"
EXPORT_INFO = "qkgeom_export.json"


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (created if needed) for the duration of the block.

    An advisory ``flock`` on <folder>/.lock: the kernel releases it when its holder exits or is
    killed, so a crashed run never leaves a stale lock, and a second process on the same folder is
    refused at once with the holder's pid in the message.
    """
    import fcntl  # POSIX: here, so that importing qkgeom on Windows reaches the CLI's one-line refusal

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / LOCK_FILE, "a+")  # noqa: SIM115 (held open for the block)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown pid"
        f.close()
        raise FolderLockedError(
            f"{folder} is in use by another qkgeom process ({holder}); wait for it or stop it"
        ) from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temp file in the same folder + rename: readers never see half a file. Every file
    qkgeom writes goes through here (tests/faultchild.py kills a process half-way through it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented, key-sorted JSON, written atomically."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    """A JSON file qkgeom wrote; a garbled one is damage (DamagedRunError names it), not a bug."""
    try:
        return json.loads(Path(path).read_text())
    except UnicodeDecodeError as e:
        raise DamagedRunError(f"{path} is not UTF-8 text ({e.reason}); fix or delete it") from None
    except json.JSONDecodeError as e:
        raise DamagedRunError(f"{path} is not valid JSON ({e}); fix or delete it") from None


def _read_parquet(path: Path) -> pd.DataFrame:
    """A parquet file qkgeom wrote; a truncated or garbled one is damage (DamagedRunError names it)."""
    import pyarrow as pa

    try:
        return pd.read_parquet(path)
    except (pa.ArrowException, OSError) as e:
        why = str(e).splitlines()[0]
        raise DamagedRunError(f"{path} is damaged ({why}); delete its folder and measure it again") from None


def is_pretrained_output(path: str | Path) -> bool:
    """A `qkgeom pretrained` output folder: one sub-folder per revision, each config.json naming its
    model and revision (our training runs' config.json have neither)."""
    p = Path(path)
    if not p.is_dir():
        return False
    for d in [p, *(x for x in p.iterdir() if x.is_dir())]:
        cfg = d / "config.json"
        if cfg.is_file():
            try:
                info = json.loads(cfg.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(info, dict) and "revision" in info and "model" in info:
                return True
    return False


class RunDir:
    """Paths and atomic readers/writers of one run folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    config = property(lambda self: self.path / "config.json")
    vocab = property(lambda self: self.path / "vocab.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    geometry = property(lambda self: self.path / "geometry.parquet")
    spectra = property(lambda self: self.path / "spectra.npz")
    checkpoints = property(lambda self: self.path / "checkpoints")
    done = property(lambda self: self.path / "done.json")
    error = property(lambda self: self.path / "error.json")
    warnings = property(lambda self: self.path / "warnings.jsonl")
    last_checkpoint = property(lambda self: self.checkpoints / LAST_CHECKPOINT)

    def is_done(self) -> bool:
        return self.done.is_file()

    def is_run(self) -> bool:
        """A run folder: it has a config.json, an error.json from a failed sweep run, or a done.json
        (a finished run whose config.json was lost is still a run: reported as damaged, not ignored)."""
        return self.config.exists() or self.error.exists() or self.done.exists()

    def write_error(self, message: str, traceback: str = "") -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.error, {"error": message, "traceback": traceback})

    def read_error(self) -> str:
        """The recorded failure, or a note that error.json itself is unreadable."""
        try:
            return str(read_json(self.error)["error"])
        except (OSError, ValueError, KeyError, TypeError):
            return "its error.json is unreadable"

    def write_vocab(self, vocab_json: str) -> None:
        atomic_write_bytes(self.vocab, vocab_json.encode())

    # metrics.jsonl -------------------------------------------------------------------------
    def append_metrics(self, row: dict[str, Any]) -> None:
        """One line per call (flushed: a killed process loses nothing; a torn last line is dropped on read)."""
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")

    def append_warning(self, row: dict[str, Any]) -> None:
        """A numerical fallback or other non-fatal event, one JSON line each."""
        with open(self.warnings, "a") as f:
            f.write(json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every row of metrics.jsonl. Only the last line may be torn (a process killed mid-append):
        it is dropped. A garbled line anywhere else is damage, refused with its line number
        (DamagedRunError), so that no valid row after it is ever lost."""
        if not self.metrics.exists():
            return []
        lines = self.metrics.read_text(errors="replace").splitlines()
        rows = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "step" not in row:
                    raise ValueError("not a metrics row")
                rows.append(row)
            except ValueError:
                if i == len(lines) - 1:
                    break  # the torn last line of a killed run
                raise DamagedRunError(
                    f"{self.metrics} line {i + 1} is garbled ({line[:40]!r}); fix or delete that line"
                ) from None
        return rows

    def truncate_metrics(self, max_step: int) -> None:
        """Keep rows with step <= max_step (resume drops what it will recompute)."""
        rows = [r for r in self.read_metrics() if r["step"] <= max_step]
        atomic_write_bytes(self.metrics, "".join(json.dumps(r) + "\n" for r in rows).encode())

    # geometry.parquet / spectra.npz ----------------------------------------------------------
    def write_geometry(self, rows: list[dict[str, Any]] | pd.DataFrame) -> None:
        buf = io.BytesIO()
        geometry_frame(rows).to_parquet(buf, index=False)
        atomic_write_bytes(self.geometry, buf.getvalue())

    def read_geometry(self) -> pd.DataFrame:
        """The run's geometry rows: geometry.parquet once the run is finished, else the probes'
        part files (a run being trained appends one part per probe: linear, not quadratic, I/O)."""
        files = [self.geometry] if self.geometry.exists() else self._parts(self.geometry_parts, ".parquet")
        if not files:
            return pd.DataFrame(columns=GEOMETRY_COLUMNS)
        df = pd.concat([_read_parquet(f) for f in files], ignore_index=True)
        # a nullable string as written (geometry_frame): pandas 3.1.0 with pyarrow 16 reads it back as `str`
        return df.assign(note=df["note"].astype("string")) if "note" in df else df

    # one part per probe while a run trains, consolidated when it finishes --------------------
    geometry_parts = property(lambda self: self.path / "geometry.parts")
    spectra_parts = property(lambda self: self.path / "spectra.parts")

    @staticmethod
    def _parts(folder: Path, suffix: str) -> list[Path]:
        return sorted(folder.glob(f"*{suffix}")) if folder.is_dir() else []

    def append_probe(self, step: int, rows: list[dict[str, Any]], spectra: dict[str, np.ndarray]) -> list[str]:
        """One probe's rows and spectra, each written atomically as a part named by its step. Returns the
        sha256 of the two parts (a checkpoint keeps them: a resume accepts only the parts its run wrote)."""
        buf = io.BytesIO()
        geometry_frame(rows).to_parquet(buf, index=False)
        geo = buf.getvalue()
        atomic_write_bytes(self.geometry_parts / f"{step:08d}.parquet", geo)
        buf = io.BytesIO()
        np.savez(buf, step=np.int64(step), **spectra)
        spec = buf.getvalue()
        atomic_write_bytes(self.spectra_parts / f"{step:08d}.npz", spec)
        return [hashlib.sha256(geo).hexdigest(), hashlib.sha256(spec).hexdigest()]

    def check_parts(self, digests: dict[int, list[str]]) -> None:
        """Refuse (DamagedRunError) a probe part on disk that is not the one this run wrote at its step
        (`digests`: step -> [geometry, spectra] sha256, as append_probe returned them)."""
        for step, want in sorted(digests.items()):
            for folder, suffix, sha in (
                (self.geometry_parts, ".parquet", want[0]),
                (self.spectra_parts, ".npz", want[1]),
            ):
                f = folder / f"{step:08d}{suffix}"
                if f.is_file() and hashlib.sha256(f.read_bytes()).hexdigest() != sha:
                    raise DamagedRunError(
                        f"cannot resume {self.path}: {folder.name}/{f.name} is not the part this run wrote at step "
                        f"{step} (copied from elsewhere or changed); nothing was changed"
                    )

    def drop_probes_after(self, step: int) -> None:
        """Delete the parts of probes after `step` (resume recomputes them)."""
        for folder, suffix in ((self.geometry_parts, ".parquet"), (self.spectra_parts, ".npz")):
            for f in self._parts(folder, suffix):
                if int(f.stem) > step:
                    f.unlink()

    def parts_from_files(self) -> None:
        """A run folder of the old layout (one geometry.parquet / spectra.npz rewritten per probe)
        resumed by this version: split them into parts, then remove them."""
        if self.geometry.exists():
            g = pd.read_parquet(self.geometry)
            for step, rows in g.groupby("step"):
                buf = io.BytesIO()
                rows.to_parquet(buf, index=False)
                atomic_write_bytes(self.geometry_parts / f"{int(step):08d}.parquet", buf.getvalue())
        if self.spectra.exists():
            sp = self.read_spectra()
            for i, step in enumerate(sp.get("step", [])):
                buf = io.BytesIO()
                np.savez(buf, **{k: v[i] for k, v in sp.items()})
                atomic_write_bytes(self.spectra_parts / f"{int(step):08d}.npz", buf.getvalue())
        self.geometry.unlink(missing_ok=True)
        self.spectra.unlink(missing_ok=True)

    def consolidate_probes(self) -> None:
        """A finished run's parts -> geometry.parquet and spectra.npz (the layout every reader of a
        finished run uses), then the parts are removed."""
        self.write_geometry(self.read_geometry())
        self.write_spectra(self.read_spectra())
        shutil.rmtree(self.geometry_parts, ignore_errors=True)
        shutil.rmtree(self.spectra_parts, ignore_errors=True)

    def write_spectra(self, spectra: dict[str, np.ndarray]) -> None:
        buf = io.BytesIO()
        np.savez(buf, **spectra)
        atomic_write_bytes(self.spectra, buf.getvalue())

    def read_spectra(self) -> dict[str, np.ndarray]:
        """Per probe, stacked along a first axis (`step` holds the steps): spectra.npz once the run
        is finished, else the probes' part files."""
        if self.spectra.exists():
            with np.load(self.spectra, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        parts = self._parts(self.spectra_parts, ".npz")
        if not parts:
            return {}
        loaded = []
        for f in parts:
            with np.load(f, allow_pickle=False) as z:
                loaded.append({k: z[k] for k in z.files})
        return {k: np.stack([d[k] for d in loaded]) for k in loaded[0]}

    # checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, state: dict[str, Any], name: str = LAST_CHECKPOINT) -> Path:
        if self.checkpoints.is_symlink():  # a run writes only inside its own folder
            raise CheckpointError(
                f"{self.checkpoints} is a link to {os.readlink(self.checkpoints)}: a run writes its checkpoints "
                "inside its own folder; remove the link"
            )
        import torch  # imported where checkpoints are touched: the reading commands need no torch

        buf = io.BytesIO()
        torch.save(state, buf)
        path = self.checkpoints / name
        atomic_write_bytes(path, buf.getvalue())
        return path

    def load_checkpoint(self, name: str = LAST_CHECKPOINT) -> dict[str, Any]:
        """Load with torch's weights-only unpickler (no arbitrary code); errors name the file."""
        import torch

        path = self.checkpoints / name
        if not path.is_file():
            raise CheckpointError(f"no checkpoint at {path}")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for truncated/corrupt zips
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({first})") from None
