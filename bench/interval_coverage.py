"""Do the intervals and tests behind qkgeom's verdicts keep their stated coverage at the n the studies use?

Every verdict rests on an interval (and a p) over independent units: seeds, a model's layers or heads.
Each one is simulated here where the truth is known, through qkgeom's own function, at the n of the
committed studies (4, 5, 8, 12, 16 seeds; 6 to 32 layers; 12 to 144 heads). Sections (`--only`):

  seeds       the t-interval over seeds (95%; the 90% that TOST reads) and the exact sign-flip test's size
              at a true mean of 0, for normal, skewed (gamma, shape 2: skewness 1.41) and heavy-tailed
              (Student t, 3 dof) per-seed values
  fisher      the Fisher-z t-interval of per-seed correlations (Pearson r of 25 probe steps), against the
              mean z it estimates (200,000 draws), at correlations 0.5 and 0.95
  comovement  claim 2's co-movement excess over 25 probe steps that share a schedule and are not coupled
              (the null: coverage of 0 by the t-interval of the per-seed excess, averaged over a study's
              cells, and the sign-flip size), with iid or random-walk noise; beside it, on the same
              series, the naive reading (a t-test of the per-seed first-difference r), the case built to
              fail; and the power at a real coupling (a quarter of --draws: n^2 correlations a cell)
  fieller     the IV ratio's Fieller interval at a strong, a moderate and a weak first stage (share of
              unbounded intervals beside it)
  median      the order-statistic interval for the median over layers (a pretrained model's contrast)
  spearman    a model's across-heads Spearman interval, stats.spearman_ci, on bivariate normal heads
  holm        Holm's family-wise error rate over 8 true nulls, independent and equicorrelated (0.5)
  rows        each committed pre-registered primary row (docs/results, as VERDICTS.md reads them): its
              t-interval's coverage in the bootstrap world of its own per-seed values (resampling them,
              the truth their mean; z for correlation rows), against the same world built from normal
              samples of its n, so that the difference is what the shape of its values costs; each row
              draws from its own generator (seeded by --seed and its study and id), so a study added
              later leaves every other row's figures as they were

Monte Carlo standard error of a coverage p over D draws: sqrt(p (1 - p) / D), 0.0034 at 0.95 and 4,000.

    python bench/interval_coverage.py [--draws 4000] [--only seeds,rows] [--out docs/results/coverage]

With --out: coverage.csv (section, statistic, setting, n, nominal, coverage, mc_se), rows.csv and
coverage.png. About 6 minutes at 4,000 draws on one core; seeded (a rerun gives the same counts).
"""

import argparse
import math
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as S
from tqdm import tqdm

from qkgeom.analysis import stats
from qkgeom.analysis.rows import per_seed_values
from qkgeom.analysis.verdict_index import primary_rows

SEEDS_N = (4, 5, 8, 12, 16)
SHAPES: dict[str, Callable[[np.random.Generator, tuple], np.ndarray]] = {  # mean 0, sd 1
    "normal": lambda g, size: g.normal(size=size),
    "skewed (gamma 2)": lambda g, size: (g.gamma(2.0, size=size) - 2.0) / math.sqrt(2.0),
    "heavy (t 3)": lambda g, size: g.standard_t(3, size=size) / math.sqrt(3.0),
}
STEPS = 25  # probe steps in a window
COUPLING = 0.1  # comovement's power: y_i = its own series + COUPLING * x_i (centred)


def row(section: str, statistic: str, setting: str, n: int, nominal: float, hits: np.ndarray) -> dict:
    p = float(np.mean(hits))
    return dict(section=section, statistic=statistic, setting=setting, n=n, nominal=nominal, coverage=p,
                mc_se=math.sqrt(p * (1 - p) / len(hits)))  # fmt: skip


def covers(lo: float, hi: float, truth: float) -> bool:
    return bool(lo <= truth <= hi)


def seeds(g: np.random.Generator, draws: int) -> Iterator[dict]:
    for shape, make in SHAPES.items():
        for n in SEEDS_N:
            x = make(g, (draws, n))
            yield row("seeds", "t-interval 95%", shape, n, 0.95, np.array([covers(*stats.t_mean_ci(v), 0) for v in x]))
            yield row("seeds", "t-interval 90% (TOST)", shape, n, 0.90,
                      np.array([covers(*stats.t_mean_ci(v, 0.90), 0) for v in x]))  # fmt: skip
            rejects = np.array([stats.sign_flip_p(v)[0] < 0.05 for v in x])
            yield row("seeds", "sign-flip test: no rejection at 0.05", shape, n, 0.95, ~rejects)


def correlations(g: np.random.Generator, rho: float, shape: tuple) -> np.ndarray:
    """Pearson r of STEPS bivariate normal pairs with correlation rho, one per leading index."""
    x = g.normal(size=(*shape, STEPS))
    y = rho * x + math.sqrt(1 - rho**2) * g.normal(size=(*shape, STEPS))
    x, y = x - x.mean(-1, keepdims=True), y - y.mean(-1, keepdims=True)
    return (x * y).sum(-1) / np.sqrt((x**2).sum(-1) * (y**2).sum(-1))


def fisher(g: np.random.Generator, draws: int) -> Iterator[dict]:
    for rho in (0.5, 0.95):
        truth = math.tanh(float(np.arctanh(correlations(g, rho, (200_000,))).mean()))
        for n in (4, 8, 16):
            r = correlations(g, rho, (draws, n))
            hits = np.array([covers(*stats.fisher_z_mean_ci(v)[1:], truth) for v in r])
            yield row("fisher", "Fisher-z t-interval 95%", f"rho {rho}", n, 0.95, hits)


def series(g: np.random.Generator, n: int, noise: str, amp_sd: float) -> list[np.ndarray]:
    """n seeds' series over STEPS probes: a shared cosine schedule (seed-varying amplitude) plus noise."""
    clock = np.cos(np.pi * np.arange(STEPS) / (STEPS - 1))
    e = g.normal(0, 0.1, (n, STEPS))
    e = np.cumsum(e, 1) if noise == "random walk" else e
    return list((1 + amp_sd * g.normal(size=(n, 1))) * clock + e)


def comovement(g: np.random.Generator, draws: int) -> Iterator[dict]:
    d = max(draws // 4, 200)  # n^2 correlations a cell: the costly section
    for noise in ("iid", "random walk"):
        for n, cells in ((4, 18), (8, 1), (16, 1)):  # (seeds, cells): the main study's 18 layers at 4 seeds, ...
            excess_hits, flip_hits, naive_hits, power_hits = [], [], [], []
            for _ in range(d):
                per_seed, observed, coupled = np.zeros((n, cells)), np.zeros((n, cells)), np.zeros((n, cells))
                for c in range(cells):
                    xs, ys = series(g, n, noise, 0.3), series(g, n, noise, 0.3)
                    res = stats.comovement_excess(xs, ys)
                    per_seed[:, c] = res["per_unit"]
                    observed[:, c] = [np.corrcoef(np.diff(a), np.diff(b))[0, 1] for a, b in zip(xs, ys, strict=True)]
                    own = [b + COUPLING * (a - a.mean()) for a, b in zip(xs, series(g, n, noise, 0.3), strict=True)]
                    coupled[:, c] = stats.comovement_excess(xs, own)["per_unit"]
                v = per_seed.mean(1)
                excess_hits.append(covers(*stats.t_mean_ci(v), 0))
                flip_hits.append(stats.sign_flip_p(v)[0] >= 0.05)
                naive_hits.append(stats.t_test_p(observed.mean(1)) >= 0.05)
                power_hits.append(stats.t_mean_ci(coupled.mean(1))[0] > 0)
            setting = f"{noise}, {cells} cell{'s' * (cells > 1)}"
            yield row("comovement", "excess t-interval 95% (null)", setting, n, 0.95, np.array(excess_hits))
            yield row("comovement", "excess sign-flip: no rejection (null)", setting, n, 0.95, np.array(flip_hits))
            yield row("comovement", "naive first-difference r: no rejection (null)", setting, n, 0.95,
                      np.array(naive_hits))  # fmt: skip
            yield row("comovement", f"excess: power at a coupling of {COUPLING}", setting, n, math.nan,
                      np.array(power_hits))  # fmt: skip


def fieller(g: np.random.Generator, draws: int) -> Iterator[dict]:
    theta = -0.4
    for n in (5, 12, 16):
        for label, sd in (("strong first stage (sd/mean 0.3)", 0.3), ("moderate (1.0)", 1.0), ("weak (3.0)", 3.0)):
            hits, unbounded = [], []
            for _ in range(draws):
                b = g.normal(1.0, sd, n)
                _, lo, hi = stats.fieller_ratio_ci(theta * b + g.normal(0, 0.5, n), b)
                hits.append(covers(lo, hi, theta))
                unbounded.append(math.isinf(lo))
            yield row("fieller", "Fieller 95%", f"{label}; unbounded {np.mean(unbounded):.2f}", n, 0.95,
                      np.array(hits))  # fmt: skip


def median(g: np.random.Generator, draws: int) -> Iterator[dict]:
    truth = float(S.gamma(2.0).median())
    for n in (6, 12, 24, 32):
        x = g.gamma(2.0, size=(draws, n))
        yield row("median", "order-statistic 95%", "gamma 2 over layers", n, 0.95,
                  np.array([covers(*stats.median_ci(v)[1:], truth) for v in x]))  # fmt: skip


def spearman(g: np.random.Generator, draws: int) -> Iterator[dict]:
    for n in (12, 48, 144):
        for rho in (0.0, 0.5, 0.9):
            truth = 6 / math.pi * math.asin(rho / 2)  # Spearman's rho of a bivariate normal
            x = g.normal(size=(draws, n))
            y = rho * x + math.sqrt(1 - rho**2) * g.normal(size=(draws, n))
            hits = np.array([covers(*stats.spearman_ci(a, b)[1:3], truth) for a, b in zip(x, y, strict=True)])
            yield row("spearman", "spearman_ci 95%", f"bivariate normal, rho {rho}", n, 0.95, hits)


def holm(g: np.random.Generator, draws: int) -> Iterator[dict]:
    m = 8
    for label, c in (("independent", 0.0), ("equicorrelated 0.5", 0.5)):
        z = math.sqrt(1 - c) * g.normal(size=(draws, m)) + math.sqrt(c) * g.normal(size=(draws, 1))
        p = 2 * S.norm.sf(np.abs(z))
        yield row("holm", "Holm: no false rejection among 8 nulls", label, m, 0.95,
                  np.array([not (stats.holm(q) < 0.05).any() for q in p]))  # fmt: skip


def own_shape(v: np.ndarray, g: np.random.Generator, draws: int) -> tuple[float, float]:
    """(coverage of the t-interval in the bootstrap world of v, the same for normal samples of v's n)."""
    n = len(v)
    hits = [covers(*stats.t_mean_ci(v[i]), v.mean()) for i in g.integers(0, n, (draws, n))]
    ref = []
    for _ in range(max(draws // 20, 50)):
        w = g.normal(size=n)
        ref += [covers(*stats.t_mean_ci(w[i]), w.mean()) for i in g.integers(0, n, (20, n))]
    return float(np.mean(hits)), float(np.mean(ref))


def row_generator(seed: int, study: str, pid: str) -> np.random.Generator:
    """One row's own stream: one shared stream would shift every later row's draws when a study sorts in."""
    return np.random.default_rng([seed, 99, zlib.crc32(f"{study}/{pid}".encode())])


def rows(results: Path, seed: int, draws: int) -> pd.DataFrame:
    out = []
    for study, pid, r in primary_rows(results):
        v = per_seed_values(getattr(r, "per_seed", ""))
        if len(v) < 3:
            continue
        fisher_z = "Fisher z" in str(getattr(r, "interval", ""))
        if fisher_z:
            v = np.arctanh(np.clip(v, -0.999999, 0.999999))
        own, ref = own_shape(v, row_generator(seed, study, pid), draws)
        out.append(dict(study=study, id=pid, n=len(v), scale="Fisher z" if fisher_z else "value",
                        skewness=float(S.skew(v)), excess_kurtosis=float(S.kurtosis(v)), own_shape=own,
                        normal_reference=ref, cost=ref - own, verdict=r.verdict))  # fmt: skip
    return pd.DataFrame(out)


SECTIONS = dict(seeds=seeds, fisher=fisher, comovement=comovement, fieller=fieller, median=median,
                spearman=spearman, holm=holm)  # fmt: skip


def plot(table: pd.DataFrame, own: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if len(own) else 2, figsize=(15 if len(own) else 10, 4.2))
    for ax, statistic, title in zip(axes, ("t-interval 95%", "sign-flip test: no rejection at 0.05"),
                                    ("t-interval over seeds", "sign-flip test (1 - size)"), strict=False):  # fmt: skip
        t = table[(table["section"] == "seeds") & (table["statistic"] == statistic)]
        for shape, s in t.groupby("setting", sort=False):
            ax.errorbar(s["n"], s["coverage"], yerr=2 * s["mc_se"], marker="o", capsize=3, label=shape)
        ax.axhline(0.95, color="grey", lw=0.8, ls="--")
        ax.set(title=title, xlabel="n (seeds)", ylabel="coverage", ylim=(0.85, 1.005))
        ax.legend(fontsize=8)
    if len(own):
        ax = axes[2]
        y = np.arange(len(own))
        ax.scatter(own["normal_reference"], y, marker="|", s=200, color="grey", label="normal values of its n")
        ax.scatter(own["own_shape"], y, color="C3", label="its own per-seed values")
        ax.set_yticks(y, [f"{s} {i} (n {n})" for s, i, n in zip(own["study"], own["id"], own["n"], strict=True)],
                      fontsize=7)  # fmt: skip
        ax.set(title="each primary row, bootstrap world", xlabel="coverage of its 95% t-interval")
        ax.invert_yaxis()
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=4000, help="Monte Carlo draws per setting (default 4000)")
    ap.add_argument("--only", default="", help=f"comma-separated sections of {', '.join([*SECTIONS, 'rows'])}")
    ap.add_argument("--results", type=Path, default=Path("docs/results"), help="committed studies for `rows`")
    ap.add_argument("--out", type=Path, help="write coverage.csv, rows.csv and coverage.png here")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    only = [s for s in a.only.split(",") if s] or [*SECTIONS, "rows"]
    if unknown := [s for s in only if s not in [*SECTIONS, "rows"]]:
        sys.exit(f"unknown section {unknown[0]!r}; sections: {', '.join([*SECTIONS, 'rows'])}")
    if a.draws < 100:
        sys.exit(f"--draws {a.draws}: at least 100 (the Monte Carlo error at 100 is already 0.022)")
    found = []
    for name in tqdm([s for s in only if s in SECTIONS], desc="sections", unit="section"):
        found += list(SECTIONS[name](np.random.default_rng([a.seed, list(SECTIONS).index(name)]), a.draws))
    table = pd.DataFrame(found)
    own = rows(a.results, a.seed, a.draws) if "rows" in only else pd.DataFrame()
    with pd.option_context("display.width", 200, "display.max_rows", 500, "display.max_colwidth", 60):
        if len(table):
            print(table.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
        if len(own):
            print("\nEach primary row's 95% t-interval in the bootstrap world of its own per-seed values:")
            print(own.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        for name, df in (("coverage.csv", table), ("rows.csv", own)):
            if len(df):
                df.to_csv(a.out / f"{name}.tmp", index=False, float_format="%.6g")
                (a.out / f"{name}.tmp").replace(a.out / name)
        plot(table, own, a.out / "coverage.png")
        print(f"written to {a.out}/")


if __name__ == "__main__":
    main()
