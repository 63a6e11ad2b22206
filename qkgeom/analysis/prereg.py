"""A study's pre-registration and the records judged under it: what pins one to the other.

A pre-registration is the text that fixes a study's primaries before it runs: the study file
(``configs/study-<name>.toml``, its comment block and ``[analysis]``), or, for a study run by a
script, the results folder's ``preregistration.toml``; and the ``[analysis]`` table the analysis
actually reads (the sweep manifest's copy, where there is one). ``digest`` hashes each of these.
Every record (analysis.records) carries the digest it was judged under; ``check_records`` refuses,
in one line naming the file, a folder whose pre-registration changed after its records were written,
unless the change was registered as a new version (``register_version``: kept in
``preregistration_versions.json`` beside the records, both versions listed in VERDICTS.md). It also
refuses records whose identity does not add up: a folder name that is not its config's run id, a
record that stopped short of its own steps, two records of one (arm, seed, budget).

Each record is also **sealed by its data**: ``seal.json`` holds the sha256 of every file of the record
(config, geometry, metrics, done, vocabulary) and its run id, and every read checks it, so an edited
byte or data moved between records is refused, naming the file. A record without a seal (written
before seals) or without a stamp is refused too; ``seal_records`` seals such records once, on purpose
(`qkgeom amend DIR --seal --note ...`).
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from datetime import date
from pathlib import Path

from qkgeom.errors import QKGeomError, read_text
from qkgeom.results import FAMILY_RECORD, RECORDS_DIR, SWEEP_MANIFEST, RunDir, read_json, write_json

SEAL = "seal.json"  # a record's data digests
PIN = "preregistration_pin.json"  # a study without records: its pre-registration and claims.csv digests
SEALED = ("config.json", "geometry.parquet", "metrics.jsonl", "done.json", "vocab.json")  # what a seal covers
PREREGISTRATION = "preregistration.toml"  # a script-run study's pre-registration, in its results folder
VERSIONS = "preregistration_versions.json"  # registered amendments of a study's pre-registration


class RecordError(QKGeomError, ValueError):
    """A study's records do not match their pre-registration, or each other."""


def study_file(path: Path) -> Path | None:
    """configs/study-<name>.toml of a results folder: by its manifest's sweep name, else by its own name."""
    from qkgeom.config import CONFIG_DIR

    path = Path(path)
    name = read_json(path / SWEEP_MANIFEST).get("name", "") if (path / SWEEP_MANIFEST).is_file() else ""
    for stem in (name, f"study-{path.name.removeprefix('study-')}"):
        if stem and (CONFIG_DIR / f"{stem}.toml").is_file():
            return CONFIG_DIR / f"{stem}.toml"
    return None


def analysis_table(f: Path) -> dict:
    """The [analysis] table of a TOML file ({} if it has none); RecordError in one line if it is not TOML."""
    try:
        return tomllib.loads(read_text(f, RecordError)).get("analysis", {})
    except tomllib.TOMLDecodeError as e:
        raise RecordError(f"{f} is not valid TOML: {e}") from None


def study_analysis(path: Path, by_name: bool = False) -> dict:
    """The [analysis] table of a study's pre-registration (primary family, margin, records): as its
    sweep manifest recorded it, else from the folder's preregistration.toml (a study run by a script,
    not a sweep), else, with by_name, from configs/study-<name>.toml for a results folder named
    study-<name> or <name> (a committed study's folder holds no manifest); {} if none has one."""
    path = Path(path)
    if (path / SWEEP_MANIFEST).is_file():
        return read_json(path / SWEEP_MANIFEST).get("analysis", {})
    files = [path / PREREGISTRATION]
    if by_name:
        files.append(study_file(path))
    for f in files:
        if f is not None and f.is_file():
            return analysis_table(f)
    return {}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(path: str | Path, analysis: dict | None = None) -> dict[str, str]:
    """sha256 of each text that pre-registers the study in `path`, keyed by what it is: the study
    file, preregistration.toml, and the [analysis] table as the analysis reads it (canonical JSON).
    analysis: the [analysis] a sweep is about to write into the manifest, checked before it is written."""
    path = Path(path)
    texts = [f for f in (study_file(path), path / PREREGISTRATION) if f is not None and f.is_file()]
    out = {f.name: _sha(f.read_bytes()) for f in texts}
    # where study_analysis reads [analysis] from: the manifest, else preregistration.toml, else the study file
    manifest = analysis is not None or (path / SWEEP_MANIFEST).is_file()
    source = SWEEP_MANIFEST if manifest else texts[-1].name if texts else "no file"
    table = study_analysis(path, by_name=True) if analysis is None else analysis
    out[f"{source} [analysis]"] = _sha(json.dumps(table, sort_keys=True).encode())
    return out


def _what(key: str) -> str:
    """A digest key by what it is, not where it was read: a pinned study's first sitting writes its
    manifest, and the same [analysis] table then reads from sweep.json, not from the study file."""
    return "[analysis]" if key.endswith(" [analysis]") else key


def _canon(d: dict[str, str]) -> dict[str, str]:
    return {_what(k): v for k, v in d.items()}


def registered_versions(path: str | Path) -> list[dict]:
    """The registered versions of a study's pre-registration (oldest first); [] where never amended."""
    f = Path(path) / VERSIONS
    return read_json(f)["versions"] if f.is_file() else []


def register_version(path: str | Path, note: str, sweep: str | Path | None = None) -> dict:
    """Register the current pre-registration of `path` as a new version (its records keep theirs):
    the first call also registers the version the records were judged under. Returns the new entry.
    sweep: the sweep file whose [analysis] the manifest takes (default: the study file, where it changed)."""
    path = Path(path)
    if not note.strip():
        raise RecordError("a new pre-registration version needs a note saying what changed and why")
    _pre_registered(path)
    versions = registered_versions(path)
    if not versions:
        judged = {json.dumps(d, sort_keys=True) for d in _record_digests(path).values()}
        if not judged:
            raise RecordError(f"{path} has no records judged under a pre-registration and is not pinned: nothing to "
                              f"amend (a study without records is pinned with --pin)")  # fmt: skip
        versions = [{"version": i + 1, "digest": json.loads(d), "note": "as first registered"}
                    for i, d in enumerate(sorted(judged))]  # fmt: skip
    table = _edited_study_analysis(path, versions[-1]["digest"] if versions else {}, sweep)
    now = digest(path, table)
    if any(_canon(v["digest"]) == _canon(now) for v in versions):
        raise RecordError(f"{path}: the current pre-registration is already registered (nothing changed)")
    if table is not None:  # the manifest takes the edited study file's [analysis]: registered, so written
        write_json(path / SWEEP_MANIFEST, {**read_json(path / SWEEP_MANIFEST), "analysis": table})
    entry = {"version": len(versions) + 1, "digest": now, "note": note.strip(), "registered": date.today().isoformat()}
    write_json(path / VERSIONS, {"versions": [*versions, entry]})
    return entry


def _pre_registered(path: Path) -> None:
    """Refuse to amend or pin a folder that nothing pre-registers (digest's "no file")."""
    if study_file(path) is None and not (path / PREREGISTRATION).is_file() and not (path / SWEEP_MANIFEST).is_file():
        raise RecordError(f"{path} has no pre-registration (configs/study-{path.name.removeprefix('study-')}.toml, "
                          f"{PREREGISTRATION} or {SWEEP_MANIFEST}): nothing to amend")  # fmt: skip


def _edited_study_analysis(path: Path, last: dict[str, str], sweep: str | Path | None = None) -> dict | None:
    """The [analysis] the manifest takes on amending, where a sweep manifest holds the one the analysis
    reads (a sitting checks before it writes the manifest, so an edited [analysis] reaches it only by
    being registered): the `sweep` file's, else the study file's where it changed since the `last`
    registered digest; else None (the manifest stays)."""
    if not (path / SWEEP_MANIFEST).is_file():
        return None
    f = Path(sweep) if sweep is not None else study_file(path)
    if f is None or (sweep is None and last.get(f.name) in (None, _sha(f.read_bytes()))):
        return None
    return analysis_table(f)


def record_folders(path: str | Path) -> list[Path]:
    """The record folders under `path`/runs/ (hidden temp folders of a killed write are not records)."""
    dest = Path(path) / RECORDS_DIR
    return sorted(d for d in dest.iterdir() if d.is_dir() and not d.name.startswith(".")) if dest.is_dir() else []


def write_pin(path: str | Path) -> dict:
    """Pin a study that has no records (its verdicts cannot be re-derived): the digest of its
    pre-registration and of its committed claims.csv, checked by check_records from then on."""
    path = Path(path)
    claims = path / "claims.csv"
    _pre_registered(path)
    if not claims.is_file():
        raise RecordError(f"{path} has no claims.csv: nothing to pin")
    pin = {"digest": digest(path), "claims.csv": _sha(claims.read_bytes())}
    write_json(path / PIN, pin)
    return pin


def _check_pin(path: Path, analysis: dict | None = None) -> None:
    """A study without records: refused if its claims.csv or its pre-registration changed since it was
    pinned (unless registered as a new version), or if it has primaries and no pin at all."""
    f, claims = path / PIN, path / "claims.csv"
    if not f.is_file():
        if claims.is_file() and study_analysis(path, by_name=True).get("primary"):
            raise RecordError(f"{path} has pre-registered primaries and no records, and is not pinned ({PIN}): "
                              f"pin it on purpose with qkgeom amend {path} --pin --note ...")  # fmt: skip
        return
    pin = read_json(f)
    if claims.is_file() and _sha(claims.read_bytes()) != pin.get("claims.csv"):
        raise RecordError(f"{path}: claims.csv changed after the study was pinned ({PIN}); restore it from git")
    _check_against(path, {PIN: pin["digest"]}, analysis)


def _record_digests(path: Path) -> dict[str, dict]:
    if not record_folders(path) and (path / PIN).is_file():  # a pinned study without records
        return {PIN: read_json(path / PIN)["digest"]}
    out = {}
    for d in record_folders(path):
        judged = read_json(RunDir(d).config).get("record", {}).get("preregistration")
        if judged is not None:
            out[d.name] = judged
    return out


def data_seal(folder: Path, run_id: str | None = None) -> dict:
    """What a record's seal holds: its run id (the folder's name) and the sha256 of each SEALED file and
    of each file of its family measurements (family/<revision>/..., a family study's record)."""
    files = {n: _sha((folder / n).read_bytes()) for n in SEALED if (folder / n).is_file()}
    if (folder / FAMILY_RECORD).is_dir():
        family = sorted(p for p in (folder / FAMILY_RECORD).rglob("*") if p.is_file())
        files |= {p.relative_to(folder).as_posix(): _sha(p.read_bytes()) for p in family}
    return {"run_id": run_id or folder.name, "files": files}


def write_seal(folder: Path, run_id: str | None = None) -> None:
    """Seal a record folder by its data (last, by analysis.records.write_record, in its temp folder:
    `run_id` names the record it becomes)."""
    write_json(folder / SEAL, data_seal(folder, run_id))


def seal_records(path: str | Path) -> list[Path]:
    """Seal every record under `path`/runs/ that has no seal yet (records written before seals); returns
    them. Sealed records are left alone: a changed one stays refused."""
    out = [d for d in record_folders(path) if not (d / SEAL).is_file()]
    for d in out:
        write_seal(d)
    return out


def _check_seals(path: Path) -> None:
    for d in record_folders(path):
        if not (d / SEAL).is_file():
            raise RecordError(
                f"record {d.name} in {path} has no {SEAL}: its data cannot be checked (seal records written "
                f"before seals on purpose: qkgeom amend {path} --seal --note ...)"
            )
        want, have = read_json(d / SEAL), data_seal(d)
        if want.get("run_id") != d.name:
            raise RecordError(f"record {d.name}: its {SEAL} is the seal of record {want.get('run_id')}")
        for name in sorted({*want.get("files", {}), *have["files"]}):
            sealed, now = want.get("files", {}).get(name), have["files"].get(name)
            if sealed != now:
                what = "is missing" if now is None else "was added" if sealed is None else "changed"
                raise RecordError(
                    f"record {d.name}: {name} {what} after the record was sealed"
                    + (f" (sha256 {now[:12]}, sealed {sealed[:12]})" if now and sealed else "")
                )


def _check_digests(path: Path, analysis: dict | None = None) -> None:
    stamps = _record_digests(path)
    for d in record_folders(path):
        if d.name not in stamps:
            raise RecordError(f"record {d.name} in {path} carries no pre-registration stamp: it is not read")
    _check_against(path, stamps, analysis)


def _check_against(path: Path, stamps: dict[str, dict], analysis: dict | None = None) -> None:
    """Refuse where a stamp (record or pin -> the digest it was judged under) is neither the current
    pre-registration nor, once the current one is registered, any registered version."""
    raw = digest(path, analysis)
    now, name = _canon(raw), {_what(k): k for k in raw}
    allowed = [now]
    versions = registered_versions(path)
    if versions and _canon(versions[-1]["digest"]) == now:
        allowed = [_canon(v["digest"]) for v in versions]
    for rid, judged in stamps.items():
        judged = _canon(judged)
        if judged in allowed:
            continue
        changed = sorted(k for k in {*judged, *now} if judged.get(k) != now.get(k))
        what = ", ".join(name.get(k, k) for k in changed)
        raise RecordError(
            f"{path}: the pre-registration ({what}) changed after its records were written "
            f"(record {rid} was judged under {judged.get(changed[0], 'none')[:12]}, now "
            f"{now.get(changed[0], 'none')[:12]}); restore it, or register the change as a new version "
            f"(qkgeom amend {path} --note ...)"
        )


def _check_identity(path: Path) -> None:
    from qkgeom import config as C

    seen: dict[tuple, str] = {}
    for d in record_folders(path):
        rd = RunDir(d)
        if not rd.is_done():
            continue
        info = read_json(rd.config)
        cfg = info.get("config", {})
        rid = info.get("run_id")
        # a sweep's run is named by its config (config.run_id: <name>-<10 hex>), a hand-named one is not
        if info.get("source") != "qkgeom.Probe" and re.fullmatch(r".+-[0-9a-f]{10}", d.name):
            try:
                rid = C.run_id(C.from_dict(cfg))
            except (KeyError, TypeError, ValueError) as e:
                raise RecordError(f"record {d} has an unreadable config ({e})") from None
        if info.get("run_id") != d.name or rid != d.name:
            raise RecordError(
                f"record folder {d.name} holds the record of run {rid} (config.json says {info.get('run_id')}): "
                "a record copied over another's folder"
            )
        step, steps = read_json(rd.done).get("step"), cfg["train"]["steps"]
        if step != steps:
            raise RecordError(f"record {d.name} finished at step {step}, not at its config's {steps} steps")
        key = (C.arm_label(cfg["intervention"]), cfg["model"]["n_layers"], cfg["model"]["qk_init"],
               cfg["train"]["seed"], cfg["train"]["data_seed"], steps)  # fmt: skip
        if key in seen:
            raise RecordError(f"records {seen[key]} and {d.name} are the same (arm, seed, budget): keep one")
        seen[key] = d.name


def check_records(path: str | Path, analysis: dict | None = None) -> None:
    """Refuse (RecordError, one line) a study folder whose records' data changed since they were sealed,
    whose records were judged under another pre-registration than the current one (unless registered
    as a new version), or whose records' identities do not add up. A folder without records passes.
    analysis: check against the [analysis] a sitting is about to write, before anything is written."""
    path = Path(path)
    if not record_folders(path):
        _check_pin(path, analysis)
        return
    _check_identity(path)  # the most specific message first (a copied folder, a short run, a twin)
    _check_seals(path)
    _check_digests(path, analysis)
