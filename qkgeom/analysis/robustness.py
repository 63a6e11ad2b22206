"""Robustness variants of a study's primary rows (issue 56): the same claim re-judged under another
reasonable choice (axis, window start, one budget or seed left out). A primary whose verdict changes
under any registered variant reads `choice-dependent`; robustness.csv keeps every variant's row.

A study registers its variant set in `[analysis] robustness` (names from the study's own VARIANTS);
an unregistered study gets no variants, and an unknown name is refused."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd
from tqdm import tqdm

from qkgeom.analysis import claims as A
from qkgeom.analysis import stats
from qkgeom.analysis.primary import plain_verdict
from qkgeom.analysis.rows import seed_row
from qkgeom.analysis.runs import AnalysisError

TABLE = "robustness"  # robustness.csv beside claims.csv
COLUMNS = ["primary", "variant", "value", "ci_low", "ci_high", "n", "p_value", "p_sign_flip", "verdict", "same"]


def registered(analysis: dict, known: Iterable[str]) -> list[str]:
    """The variant families a study's [analysis] registers, checked against those its analysis knows."""
    names = list(analysis.get("robustness", []))
    unknown = [v for v in names if v not in set(known)]
    if unknown:
        raise AnalysisError(f"unknown robustness variant {unknown[0]!r} (known: {', '.join(known)})")
    return names


def variant_table(primary: dict[str, pd.Series], variants: Iterable[tuple[str, dict[str, pd.Series]]]) -> pd.DataFrame:
    """One row per (primary id, variant): the variant's estimate, interval, n, p, sign-flip p and
    verdict, and whether the verdict is the registered one's (`same`; `(parametric only)` ignored)."""
    rows = []
    for name, found in variants:
        for cid, r in found.items():
            rows.append({
                "primary": cid, "variant": name, "value": r["value"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                "n": r["n"], "p_value": r["p_value"], "p_sign_flip": r.get("p_sign_flip"), "verdict": r["verdict"],
                "same": plain_verdict(r["verdict"]) == plain_verdict(primary[cid]["verdict"]),
            })  # fmt: skip
    return pd.DataFrame(rows, columns=COLUMNS).sort_values(["primary"], kind="stable").reset_index(drop=True)


def reading(table: pd.DataFrame, cid: str) -> str:
    """A primary's word on its variants: `robust (k variants)`, `choice-dependent (j of k variants
    differ)`, or '' where none were registered."""
    mine = table[table["primary"] == cid]
    if mine.empty:
        return ""
    same = mine["same"].astype(str).str.lower().eq("true")
    differ = int((~same).sum())
    return (
        f"robust ({len(mine)} variants)"
        if differ == 0
        else f"choice-dependent ({differ} of {len(mine)} variants differ)"
    )


SEED_VARIANT = "leave one seed out"  # what a study of contrasts or trends (causal, family) can register


def leave_one_seed_out(
    claims: pd.DataFrame, seeds: Iterable[int], rebuild: Callable[[int], pd.DataFrame]
) -> pd.DataFrame:
    """robustness.csv of a study whose primaries are contrasts or trends (an intervention study's arms,
    a family study's trends): each primary row re-judged by the study's own claims builder on its
    records without each seed in turn. rebuild(seed) -> the claims table without that seed; a primary
    is found there by its claim_id, group and window."""
    primaries = claims[claims["primary"] != ""]
    found = {r.primary: pd.Series(r._asdict()) for r in primaries.itertuples(index=False)}
    variants = []
    seeds = list(seeds)  # a terminal's stderr shows how far the rebuilds are (1 s each in causal-v4-cpu)
    for seed in tqdm(seeds, desc="leave one seed out", unit="seed", disable=None, leave=False):
        other = rebuild(seed)
        picked = {}
        for r in primaries.itertuples(index=False):
            m = other[(other["claim_id"] == r.claim_id) & (other["group"] == r.group) & (other["window"] == r.window)]
            if len(m) == 1:
                picked[r.primary] = m.iloc[0]
        variants.append((f"leave out seed {seed}", picked))
    return variant_table(found, variants) if found else pd.DataFrame(columns=COLUMNS)


def only_seed_variant(families: Iterable[str]) -> None:
    """A study whose primaries are not slopes can register only SEED_VARIANT (an axis or window variant
    would not vary its statistic): anything else is refused."""
    other = [f for f in families if f != SEED_VARIANT]
    if other:
        raise AnalysisError(f"robustness variant {other[0]!r} applies to slope primaries; this study's primaries "
                            f"are contrasts or trends: register only {SEED_VARIANT!r}")  # fmt: skip


# The main study's primaries (a slope, or co-movement beyond the shared clock, pooled over layers and
# runs per seed) re-judged: against log2(step) instead of the fraction of training; from half of
# training on (or the transient end, if later); without each seed in turn.
MAIN_VARIANTS = ("axis: log step", "window: later start", "leave one seed out")


def pooled_primaries(claims: pd.DataFrame) -> list[tuple[tuple, tuple]]:
    """A main study's pooled primary rows (group `all`, post-transient) whose claim is a slope or a
    co-movement, each with what it measures: ("slope", metric, sign) or ("comovement", x, y, sign),
    found by its claim_id (claims.SLOPE_CLAIMS / CORRELATION_CLAIMS), never by its wording."""
    kinds = {f"slope:{metric}": ("slope", metric, sign) for metric, _, sign in A.SLOPE_CLAIMS}
    kinds |= {f"comove:{x}:{y}": ("comovement", x, y, sign) for x, y, _, sign in A.CORRELATION_CLAIMS}
    rows = claims[(claims["primary"] != "") & (claims["group"] == "all") & (claims["window"] == "post-transient")]
    return [(r, kinds[r.claim_id]) for r in rows.itertuples(index=False) if r.claim_id in kinds]


def _per_seed(w: pd.DataFrame, kind: tuple, axis: str = "progress") -> np.ndarray:
    """A main claim's per-seed values on window rows `w`, as claims_main computes them (slopes: per
    (run, layer) OLS slope, then the mean over a seed's runs and layers), on `axis`."""
    if kind[0] == "comovement":
        return A.comovement_per_seed(A.comovement_table(w), kind[1], kind[2])[0]
    rows = w[(w["head"] == -1) & (w["metric"] == kind[1])].sort_values("step")
    if axis == "log step":
        rows = rows[rows["step"] > 0]
    x = "progress" if axis == "progress" else "log_step"
    rows = rows.assign(log_step=np.log2(rows["step"].clip(lower=1)))
    slopes = rows.groupby(["run_id", "seed", "layer"]).apply(
        lambda g: stats.slope(g[x].to_numpy(float), g["value"].to_numpy(float)), include_groups=False
    )
    return slopes.groupby("seed").mean().dropna().to_numpy()


def main_variants(
    base: pd.DataFrame, claims: pd.DataFrame, margin: float, families: Iterable[str] = MAIN_VARIANTS
) -> pd.DataFrame:
    """robustness.csv of a main study: its pooled primary rows (group `all`, post-transient) whose
    claim is a slope or a co-movement, re-judged under each variant of the registered `families`.
    base: the unconstrained runs' rows with transient ends (claims.with_transient). Each primary's
    per-seed values are first recomputed as registered and must give its committed value (else the
    variants would not vary the registered statistic: an error)."""
    families, found, variants = set(families), {}, []
    post = A.window(base, "post-transient")
    later = base[base["step"] >= np.maximum(base["transient_end"], base["steps"] / 2)]
    for r, kind in pooled_primaries(claims):
        found[r.primary] = pd.Series(r._asdict())
        if not np.isclose(np.mean(_per_seed(post, kind)), r.value, rtol=1e-9, atol=1e-12):
            raise AnalysisError(f"robustness: primary {r.primary} does not recompute to its value {r.value}")

        def judged(v: np.ndarray, name: str, r=r, kind=kind) -> tuple[str, dict]:
            row = seed_row(v, study="main", claim=r.claim, claim_id=r.claim_id, group="all", window=name,
                           sign=kind[-1], note="", margin=margin)  # fmt: skip
            return name, {r.primary: pd.Series(row)}

        if "axis: log step" in families and kind[0] == "slope":
            variants.append(judged(_per_seed(post, kind, "log step"), "axis: log2 step (not the fraction of training)"))
        if "window: later start" in families:
            variants.append(judged(_per_seed(later, kind), "window: from half of training (or the transient end)"))
        if "leave one seed out" in families:
            for s in sorted(post["seed"].unique()):
                variants.append(judged(_per_seed(post[post["seed"] != s], kind), f"leave out seed {s}"))
    return variant_table(found, variants) if found else pd.DataFrame(columns=COLUMNS)
