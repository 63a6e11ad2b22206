"""docs/results/VERDICTS.md: every pre-registered primary row of every committed study, under its
current statistics, judged and Holm-adjusted (`qkgeom verdicts docs/results`)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import claims as A
from qkgeom.analysis import layers
from qkgeom.analysis import primary as P
from qkgeom.analysis import robustness as R
from qkgeom.analysis.prereg import check_records, registered_versions, study_analysis
from qkgeom.analysis.study import fmt, wrap_lines
from qkgeom.results import RECORDS_DIR, DamagedRunError

CLAIMS_NEEDED = ("claim", "group", "window", "value", "ci_low", "ci_high", "n", "verdict", "p_value", "detail")


def _committed_claims(path: Path) -> pd.DataFrame:
    """A committed claims.csv, refused in one line (DamagedRunError) where it is truncated or garbled."""
    if not path.read_bytes().endswith(b"\n"):  # every table qkgeom writes ends its last row
        raise DamagedRunError(f"{path} is damaged (its last row is cut off); re-derive it with qkgeom analyze")
    try:
        claims = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise DamagedRunError(
            f"{path} is damaged ({str(e).splitlines()[0]}); re-derive it with qkgeom analyze"
        ) from None
    lost = [c for c in CLAIMS_NEEDED if c not in claims.columns]
    if lost or claims["p_value"].map(lambda v: isinstance(v, str) and v != "").any():
        what = f"no column {lost[0]!r}" if lost else "a p_value that is not a number"
        raise DamagedRunError(f"{path} is damaged ({what}; truncated?); re-derive it with qkgeom analyze")
    claims["verdict"] = claims["verdict"].fillna("")
    if "claim_id" not in claims:  # written before claim ids: no pre-registration can name its rows
        claims["claim_id"] = ""
    return claims


def current_claims(d: Path) -> pd.DataFrame:
    """A committed study's claims as its current statistics give them: claims.csv, with the rows of its
    newest re-derived table of primaries (`*claims_v<N>.csv`, N >= 2: statistics re-derived from a
    committed per-seed table after the study ran) in place of the rows of the same claim."""
    claims = _committed_claims(d / "claims.csv")
    newer = sorted(
        (f for f in d.glob("*claims_v*.csv") if re.search(r"_v(\d+)\.csv$", f.name)),
        key=lambda f: int(re.search(r"_v(\d+)\.csv$", f.name).group(1)),
    )
    newer = [f for f in newer if int(re.search(r"_v(\d+)\.csv$", f.name).group(1)) >= 2]
    if newer:
        v2 = _committed_claims(newer[-1])
        key = ["claim_id", "group", "window"]
        same = claims.set_index(key).index.isin(v2.set_index(key).index) & (claims["claim_id"] != "")
        claims = pd.concat([v2, claims[~same]], ignore_index=True)
    return claims


def plain(note: str) -> str:
    """An amendment's note as one line of inert Markdown text: whitespace runs to one space, and the
    characters that would start markup or HTML (< > | ` * _ [ ] #) escaped."""
    text = " ".join(note.split())
    return re.sub(r"([<>|`*_\[\]#\\])", r"\\\1", text)


SURVIVES = {"yes": "survives", "no": "does not survive", "not tested": "not tested: unreadable"}


def terminal_summary(markdown: str, width: int = 100) -> str:
    """The rows of a verdicts_index table for a terminal, no line wider than `width`: per primary row,
    study, id, n-aware verdict, measured [95% CI], n and Holm (study), then the claim wrapped."""
    out = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 18 or cells[0] in ("study", "---"):
            continue
        study, cid, claim, group, window, measured, n, verdict, _, _, _, _, p_holm, survives = cells[:14]
        head = f"{study} {cid}: {verdict}; {measured}, n {n}; Holm (study) {p_holm or '-'}"
        head += f" ({SURVIVES.get(survives, survives)})" if survives else ""
        head += "; its layers disagree in sign" if cells[17].startswith("disagree") else ""
        out += wrap_lines(head, width) + wrap_lines(f"{claim} ({group}, {window})", width, "    ")
    return "\n".join(out)


def _collect(root: Path) -> tuple[list, list, dict[str, pd.DataFrame], dict[str, pd.DataFrame]]:
    """Every committed study's primary rows (study, id, row, has records), its registered versions, and
    its robustness.csv and per_layer.csv where it has them; damaged or bent studies refused."""
    found, amended = [], []
    variants: dict[str, pd.DataFrame] = {}  # study -> its robustness.csv (analysis.robustness)
    by_layer: dict[str, pd.DataFrame] = {}  # study -> its per_layer.csv (analysis.layers)
    for d in sorted(p for p in root.iterdir() if (p / "claims.csv").is_file()):
        spec = study_analysis(d, by_name=True).get("primary", [])
        if not spec:
            continue
        current = current_claims(d)  # a damaged claims.csv is named first
        check_records(d)  # records judged under another pre-registration, or bent: refused
        amended += [(d.name, v) for v in registered_versions(d)]
        if (d / f"{R.TABLE}.csv").is_file():
            variants[d.name] = pd.read_csv(d / f"{R.TABLE}.csv")
        if (d / f"{layers.TABLE}.csv").is_file():
            by_layer[d.name] = pd.read_csv(d / f"{layers.TABLE}.csv", keep_default_na=False, na_values=[""])
        try:  # a primary that picks no row of its claims.csv, or several, is refused (adjust_primary)
            claims = P.adjust_primary(current, spec)
        except A.AnalysisError as e:
            raise A.AnalysisError(f"{d.name}: {e}") from None
        for spec_row in spec:
            for r in claims[claims["primary"] == spec_row["id"]].itertuples(index=False):
                found.append((d.name, spec_row["id"], r, (d / RECORDS_DIR).is_dir()))
    return found, amended, variants, by_layer


def primary_rows(root: str | Path) -> list[tuple[str, str, object]]:
    """(study, primary id, claims row) of every pre-registered primary row of the studies under `root`,
    the rows VERDICTS.md judges (a namedtuple of the study's current claims columns)."""
    return [(study, pid, row) for study, pid, row, _ in _collect(Path(root))[0]]


def _tested(found: list) -> tuple[list, np.ndarray, np.ndarray]:
    """Per row (sign-flip p, floor, Holm input p or NaN where the row is unreadable), then Holm over
    every study's rows (descriptive) and within each study (the error control)."""
    tested = []
    for _, _, r, _ in found:
        v = A.per_seed_values(getattr(r, "per_seed", ""))  # a table without the column: no sign-flip p
        flip, floor = A.stats.sign_flip_p(v) if len(v) else (np.nan, np.nan)
        tested.append((flip, floor, P.error_control_p(r.p_value, flip) if P.readable(r.verdict) else np.nan))
    p_in = np.array([t[2] for t in tested])
    p_all = A.stats.holm(p_in)
    p_study = np.full(len(found), np.nan)
    for study in {s for s, _, _, _ in found}:
        mine = np.array([s == study for s, _, _, _ in found])
        p_study[mine] = A.stats.holm(p_in[mine])
    return tested, p_study, p_all


def verdicts_index(root: str | Path) -> str:
    """docs/results/VERDICTS.md: every pre-registered primary row of every committed study under its
    current statistics (current_claims), with its raw p, the exact sign-flip p from its per-seed values
    (and the smallest p its n can reach), its n-aware verdict (analysis.claims.n_aware), Holm over the
    study's primary family (the error control) and, descriptively, over every study's primary rows
    together; whether the row re-derives from committed per-run records. A pre-registered primary that
    picks no row, or several, is an error (a reworded claim would otherwise leave its Holm family in silence)."""
    if not Path(root).is_dir():
        raise A.AnalysisError(f"{root} is not a folder")
    found, amended, variants, by_layer = _collect(Path(root))
    if not found:
        raise A.AnalysisError(f"no committed study under {root}: no <study>/claims.csv whose pre-registration "
                              "names primary rows ([analysis] primary); verdicts reads a folder of studies, such "
                              "as docs/results")  # fmt: skip
    tested, p_study, p_all = _tested(found)
    lines = [
        "# Pre-registered primary rows of every committed study",
        "",
        "Written by `qkgeom verdicts docs/results` from each study's committed claims (its current statistics:",
        "claims.csv, or a newer re-derived table of its primaries, `*claims_v<N>.csv` with N >= 2) and the",
        "primary family its pre-registration names (`[analysis] primary`). p: the row's own test as committed",
        "(t-test over seeds; the causal rows' sign test). p (sign-flip): exact, from the committed per-seed",
        "values; floor: the smallest p n seeds can reach. A verdict whose floor is >= 0.05 (n <= 5) reads",
        "`(parametric only)`: no distribution-free test at that n can reach 0.05, so it rests on normality.",
        "Holm input: the larger of p and p (sign-flip), a p that a distribution-free test reaches at the",
        "row's n, so a `(parametric only)` row cannot survive. Holm (study), over the study's primary",
        "family, is the error control: a holds/fails verdict whose Holm p is >= 0.05 does not survive it.",
        "A row whose manipulation or scale check failed is unreadable: it enters no Holm family (`not",
        "tested`). Holm (all studies) is descriptive and moves as studies are added. records: whether the",
        "row re-derives from committed per-run records (tests/analysis/test_records.py). variants: the registered",
        "robustness variants (axis, window start, one budget or seed left out; the study's robustness.csv):",
        "a verdict that changes under any of them reads `choice-dependent`, and its differing variants are",
        "listed below the table. Blank: the study registers none. layers: for a primary that averages",
        "layers, whether any two layers' 95% intervals lie on opposite sides of 0 (then the pooled row is",
        "their net); its per-layer rows, with Holm over the claim's layers, are listed below the table.",
        "claim: the row's wording, then its claim_id (`...`), by which the pre-registration names it.",
        "Coverage: a 95% t-interval over skewed per-seed values covers less (0.91-0.93 at skewness 1.4, and",
        "the sign-flip test assumes symmetry); bench/interval_coverage.py measures each interval and reads",
        "every row below under the shape of its own per-seed values (docs/results/coverage/rows.csv).",
        "",
        "| study | id | claim | group | window | measured [95% CI] | n | verdict | p | p (sign-flip) | floor "
        "| Holm input | p (Holm, study) | survives Holm (study) | p (Holm, all studies; descriptive) | records "
        "| variants | layers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (study, cid, r, recorded), (flip, floor, p_i), p_s, p_a in zip(found, tested, p_study, p_all, strict=True):
        ci = f" [{fmt(r.ci_low)}, {fmt(r.ci_high)}]" if pd.notna(r.ci_low) else ""
        judged = r.verdict in ("holds", "fails")
        survives = ("yes" if p_s < 0.05 else "no") if judged else "" if P.readable(r.verdict) else "not tested"
        robust = R.reading(variants[study], cid) if study in variants else ""
        signs = layers.sign_reading(by_layer[study], cid) if study in by_layer else ""
        verdict = A.n_aware(r.verdict, floor) + (", choice-dependent" if robust.startswith("choice") else "")
        lines.append(
            f"| {study} | {cid} | {r.claim} `{r.claim_id}` | {r.group} | {r.window} | {fmt(r.value)}{ci} | {r.n} | "
            f"{verdict} | {fmt(r.p_value)} | {fmt(flip)} | {fmt(floor)} | {fmt(p_i)} | "
            f"{fmt(p_s)} | {survives} | {fmt(p_a)} | {'yes' if recorded else 'not re-derivable'} | {robust} | {signs} |"
        )
    return "\n".join(lines + _layer_lines(by_layer) + _variant_lines(variants) + _version_lines(amended)) + "\n"


def _layer_lines(by_layer: dict[str, pd.DataFrame]) -> list[str]:
    """The per-layer rows of the primaries that average layers, as a table (none: no lines)."""
    lines: list[str] = []
    rows_by_layer = [(study, t) for study, t in sorted(by_layer.items()) if len(t)]
    if rows_by_layer:
        lines += [
            "",
            "Per-layer rows of the primaries that average layers (the study's per_layer.csv; Holm over the claim's",
            "layers on the larger of p and the sign-flip p; secondary to the study's family):",
            "",
            "| study | id | layer | measured [95% CI] | n | seeds agreeing | verdict | p (Holm, layers) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {study} | {v.primary} | {v.group.removeprefix('layer ')} | {fmt(v.value)} [{fmt(v.ci_low)}, "
            f"{fmt(v.ci_high)}] | {v.n} | {v.seeds_agreeing} | {A.n_aware(v.verdict, v.p_floor)} | "
            f"{fmt(v.p_holm_layers)} |"
            for study, t in rows_by_layer
            for v in t.itertuples(index=False)
        ]
    return lines


def _variant_lines(variants: dict[str, pd.DataFrame]) -> list[str]:
    """The robustness variants under which a primary's verdict differs (none: no lines)."""
    lines: list[str] = []
    differing = [(study, t[~t["same"].astype(str).str.lower().eq("true")]) for study, t in sorted(variants.items())]
    if any(len(t) for _, t in differing):
        lines += [
            "",
            "Variants under which a primary's verdict differs from its registered one (every variant: the study's",
            "robustness.csv):",
            "",
            "| study | id | variant | measured [95% CI] | n | p | p (sign-flip) | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [f"| {study} | {v.primary} | {v.variant} | {fmt(v.value)} [{fmt(v.ci_low)}, {fmt(v.ci_high)}] | "
                  f"{v.n} | {fmt(v.p_value)} | {fmt(v.p_sign_flip)} | {v.verdict} |"
                  for study, t in differing for v in t.itertuples(index=False)]  # fmt: skip
    return lines


def _version_lines(amended: list) -> list[str]:
    """Every registered version of a pre-registration amended after its records, oldest first."""
    lines: list[str] = []
    if amended:
        lines += [
            "",
            "Pre-registration versions (registered amendments; the records keep the digest they were judged under):",
            "",
        ]
        lines += [f"- {study} v{v['version']}{' (' + v['registered'] + ')' if v.get('registered') else ''}: "
                  f"{plain(v['note'])}" for study, v in amended]  # fmt: skip
    return lines
