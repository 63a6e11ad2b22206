"""Every interval the docs quote ("x [lo, hi]") is a row of a committed CSV, at the printed precision.

README.md, docs/LOG.md and docs/results/VERDICTS.md quote results as an estimate with its interval.
Each such triple must be found in one row of a CSV under docs/results/ (per-run records aside): all
three numbers in that row, each equal to a cell once rounded to the digits printed. The few triples
that no study CSV holds (benchmark ratios, readings of runs later re-run or of an accumulating
study's interim) are listed below, each under its reason, so a new number is either in a CSV or
named here. A triple can also meet a row by chance: causal-v4's interim +0.065 [−0.052, +0.182] is, to
its digits, keys-cpu's replica row of last-layer PR_K ↔ entropy co-movement, so it is not listed.
"""

from __future__ import annotations

import csv
import itertools
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
NUM = r"[+\-−]?\d+(?:\.\d+)?"
TRIPLE = re.compile(rf"(?<![\w.])({NUM})\s+\[({NUM}),\s+({NUM})\]")

# triples quoted in the docs that no committed study CSV holds, by reason
NOT_IN_A_CSV = {
    "benchmark ratios (bench/*.py output, measured in the session the LOG names)": {
        "1.14 [0.79, 1.50]", "1.047 [1.042, 1.052]", "1.042 [1.040, 1.044]", "1.62 [1.19, 2.04]",
        "1.15 [0.86, 1.45]", "1.154 [0.603, 1.706]", "1.0471 [1.0422, 1.0520]", "1.056 [1.033, 1.079]",
        "1.0617 [1.0565, 1.0669]", "1.0849 [1.0755, 1.0943]", "1.029 [0.895, 1.164]",
        "1.0443 [1.0396, 1.0490]", "1.065 [0.962, 1.168]", "1.0598 [1.0559, 1.0637]",
        "1.0842 [1.0651, 1.1033]", "1.044 [1.040, 1.049]", "0.986 [0.793, 1.178]", "1.0423 [1.0402, 1.0444]",
        "0.989 [0.547, 1.431]", "1.0612 [1.0501, 1.0723]", "1.062 [0.877, 1.246]", "1.0816 [1.0632, 1.0999]",
        "1.144 [0.789, 1.500]", "0.980 [0.690, 1.269]",
    },
    "the first cpu study (300 steps, before the committed re-run) and its post-transient means": {
        "−18.1 [−19.4, −16.9]", "+0.13 [0.0002, 0.25]", "−17.6 [−18.7, −16.8]", "+1.09 [0.96, 1.21]",
        "−0.49 [−0.72, −0.11]", "−0.95 [−1.21, −0.75]", "+0.200 [0.182, 0.220]", "+0.038 [0.024, 0.051]",
    },
    "intervention-cpu's first, unfinished sitting (26 of 35 runs)": {
        "−0.08 [−0.14, −0.01]", "+0.27 [0.10, 0.44]", "−0.08 [−0.59, 0.43]",
    },
    "the smoke study's first row, run fresh here and in the README's screenshot (runs/, not committed)": {
        "0.273 [0.141, 0.406]", "0.306 [0.141, 0.47]",
    },
    "causal-v4-cpu's interim readings, before its 12 seeds were in (checks only)": {
        "−0.221 [−0.228, −0.214]", "−0.238 [−0.247, −0.229]", "+0.224 [0.182, 0.267]",
        "+0.229 [0.164, 0.294]", "+0.66 [0.31, 1.02]", "+0.59 [0.54, 0.64]",
    },
}  # fmt: skip
EXEMPT = set().union(*NOT_IN_A_CSV.values())
DOCS = ["README.md", "docs/LOG.md", "docs/results/VERDICTS.md"]


def _value(s: str) -> float:
    return float(s.replace("−", "-"))


def _half_ulp(s: str) -> float:
    """Half a unit in the last printed digit (with room for a tie rounded either way)."""
    digits = len(s.split(".")[1]) if "." in s else 0
    return 0.5 * 10.0**-digits * (1 + 1e-6)


class CsvCells:
    """Every numeric cell of the committed CSVs, sorted, with its row and its place in the row; a triple
    quoted inside a text cell (a detail column) counts as a row of its own."""

    def __init__(self, root: Path = RESULTS) -> None:
        values: list[float] = []
        rows: list[int] = []
        ids = itertools.count()  # one id per CSV record and one per triple found in a text cell
        for path in sorted(root.rglob("*.csv")):
            if "runs" in path.relative_to(root).parts:
                continue
            with path.open(newline="") as fh:
                for record in csv.reader(fh):
                    row = next(ids)
                    for cell in record:
                        try:
                            values.append(float(cell))
                            rows.append(row)
                        except ValueError:
                            for m in TRIPLE.finditer(cell):
                                values += [_value(x) for x in m.groups()]
                                rows += [next(ids)] * 3
        order = np.argsort(values, kind="stable")  # cells were appended in row order: index = place
        self.values, self.rows, self.places = np.asarray(values)[order], np.asarray(rows)[order], order

    def _near(self, s: str) -> dict[int, list[int]]:
        """{row: places of its cells equal to s once rounded to s's digits}"""
        v, tol = _value(s), _half_ulp(s)
        lo = np.searchsorted(self.values, v - tol, side="left")
        hi = np.searchsorted(self.values, v + tol, side="right")
        out: dict[int, list[int]] = {}
        for row, place in zip(self.rows[lo:hi].tolist(), self.places[lo:hi].tolist(), strict=True):
            out.setdefault(row, []).append(place)
        return out

    def holds(self, estimate: str, low: str, high: str) -> bool:
        """Whether one CSV row holds the three printed numbers in three cells in that order (as value,
        ci_low, ci_high stand), so digits scattered over a row's other columns do not add up to one."""
        e, lo, hi = self._near(estimate), self._near(low), self._near(high)
        return any(
            any(a < b < c for a in e[row] for b in lo[row] for c in hi[row]) for row in e.keys() & lo.keys() & hi.keys()
        )


@pytest.fixture(scope="module")
def cells() -> CsvCells:
    return CsvCells()


def unmatched(text: str, cells: CsvCells) -> list[tuple[int, str]]:
    """(line, triple) of every "x [lo, hi]" in text that no CSV row holds, wrapped lines included."""
    out = []
    for m in TRIPLE.finditer(text):
        if not cells.holds(*m.groups()):
            out.append((text.count("\n", 0, m.start()) + 1, re.sub(r"\s+", " ", m[0])))
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_quoted_interval_is_a_row_of_a_committed_csv(doc, cells):
    bad = [f"{doc}:{line}: {t}" for line, t in unmatched((ROOT / doc).read_text(), cells) if t not in EXEMPT]
    assert not bad, "intervals in no committed CSV (fix the number, or list it with its reason):\n" + "\n".join(bad)


def test_the_exemptions_are_all_still_quoted(cells):
    """An exemption that no doc quotes any more, or that a CSV now holds, is dropped from the list."""
    quoted = {t for doc in DOCS for _, t in unmatched((ROOT / doc).read_text(), cells)}
    assert EXEMPT <= quoted, sorted(EXEMPT - quoted)


def test_a_misrounded_bound_is_caught(cells):
    # causal-v4-cpu S4, none - sham entropy in layer 1: 0.032561, [0.0084999, 0.056623] in claims.csv
    assert unmatched("none − sham +0.033 [+0.008, +0.057] (layer 1)", cells) == []
    assert unmatched("none − sham +0.033 [+0.009, +0.057] (layer 1)", cells) == [(1, "+0.033 [+0.009, +0.057]")]
    assert unmatched("IV −0.403\n[−0.571, −0.257]", cells) == []
    assert unmatched("IV −0.404 [−0.571, −0.257]", cells) == [(1, "−0.404 [−0.571, −0.257]")]
    # the same digits from another row's cells do not add up to a row
    assert unmatched("+0.033 [+0.008, −0.257]", cells) != []
