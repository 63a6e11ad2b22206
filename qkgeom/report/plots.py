"""Figures: tidy DataFrames in, matplotlib Figures out (no files, no state).

x axes are optimiser steps on a symlog scale, since the early regime matters.
"""

from __future__ import annotations

import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from qkgeom.metrics import metric_label  # noqa: E402

COLORS = {"query": "tab:blue", "key": "tab:orange"}


def subplots(*args, **kw):
    """plt.subplots under constrained layout: titles and colorbars never overlap a panel."""
    return plt.subplots(*args, layout="constrained", **kw)


def _grid(df: pd.DataFrame, size: float = 3.2):
    depths, inits = sorted(df["n_layers"].unique()), sorted(df["qk_init"].unique())
    fig, axes = subplots(
        len(depths), len(inits), figsize=(size * len(inits), 0.8 * size * len(depths)), squeeze=False, sharex=True
    )
    return fig, axes, depths, inits


def _band(ax, per_run: pd.DataFrame, color: str, label: str) -> None:
    """per_run: index step, columns runs; mean line and min-max band over runs (seeds)."""
    ax.plot(per_run.index, per_run.mean(axis=1), color=color, label=label, lw=1.5)
    ax.fill_between(per_run.index, per_run.min(axis=1), per_run.max(axis=1), color=color, alpha=0.25, lw=0)


def pr_trajectories(df: pd.DataFrame, post_transient: bool = False) -> Figure:
    """Layer-mean PR_Q and PR_K against step, per depth x init, with min-max bands over seeds:
    the whole run on a symlog axis, or (post_transient) the window the claims live in, linear."""
    fig, axes, depths, inits = _grid(df)
    rows = df[df["head"] == -1]
    if post_transient:
        rows = rows[rows["step"] >= rows["transient_end"]]
    for i, d in enumerate(depths):
        for j, init in enumerate(inits):
            ax = axes[i, j]
            sub = rows[(rows["n_layers"] == d) & (rows["qk_init"] == init)]
            for side in ("query", "key"):
                m = sub[sub["metric"] == f"{side}_participation_ratio"]
                per_run = m.groupby(["step", "run_id"])["value"].mean().unstack("run_id")
                _band(ax, per_run, COLORS[side], f"PR_{side[0].upper()}")
            if "transient_end" in sub and len(sub) and not post_transient:
                ax.axvline(sub["transient_end"].median(), color="k", ls=":", lw=1, label="transient end (median)")
            if not post_transient:
                ax.set_xscale("symlog", linthresh=1)
            ax.set_title(f"depth {d}, {init}", fontsize=9)
            if j == 0:
                ax.set_ylabel("PR (layer mean)")
            if i == len(depths) - 1:
                ax.set_xlabel("step")
    axes[0, 0].legend(fontsize=8)
    window = "after each run's transient" if post_transient else "over training"
    fig.suptitle(f"PR_Q and PR_K {window} (band: min-max over seeds)")
    return fig


def contrast_heatmap(df: pd.DataFrame) -> Figure:
    """Seed-mean PR_Q - PR_K per layer (rows) and probe step (columns), per depth x init."""
    fig, axes, depths, inits = _grid(df)
    c = df[(df["head"] == -1) & (df["metric"] == "participation_ratio_contrast")]
    grids = {
        (d, i): g.groupby(["layer", "step"])["value"].mean().unstack("step")
        for (d, i), g in c.groupby(["n_layers", "qk_init"])
    }
    lim = max((float(np.nanmax(np.abs(g.to_numpy()))) for g in grids.values()), default=1.0) or 1.0
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-lim, vmax=lim)
    im = None
    for i, d in enumerate(depths):
        for j, init in enumerate(inits):
            ax = axes[i, j]
            if (d, init) not in grids:
                ax.set_axis_off()
                continue
            grid = grids[(d, init)]
            im = ax.imshow(grid.to_numpy(), aspect="auto", cmap="RdBu_r", norm=norm, origin="lower")
            steps = list(grid.columns)
            ticks = np.linspace(0, len(steps) - 1, min(5, len(steps))).astype(int)
            ax.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=7)
            ax.set_title(f"depth {d}, {init}", fontsize=9)
            ax.set_ylabel("layer" if j == 0 else "")
            ax.set_xlabel("step (probe index)" if i == len(depths) - 1 else "")
    fig.colorbar(im, ax=axes, shrink=0.8, label="PR_Q - PR_K (seed mean)")
    fig.suptitle("Paired contrast per layer over training (red: queries more dispersed)")
    return fig


def entropy_vs_prk(df: pd.DataFrame) -> Figure:
    """Attention entropy against PR_K, one point per run x layer x probe step, coloured by init."""
    rows = (
        df[df["head"] == -1]
        .pivot_table(index=["run_id", "qk_init", "layer", "step"], columns="metric", values="value")
        .reset_index()
    )
    fig, ax = subplots(figsize=(6, 4.5))
    for init, g in rows.groupby("qk_init"):
        ax.scatter(g["key_participation_ratio"], g["attention_entropy"], s=6, alpha=0.5, label=init)
    ax.set_xlabel("PR_K (layer)")
    ax.set_ylabel("attention entropy (nats, layer mean)")
    ax.legend(title="qk_init", fontsize=8)
    ax.set_title("Attention entropy vs key participation ratio")
    return fig


def interaction_spectra(spectra: dict[str, tuple[np.ndarray, np.ndarray]]) -> Figure:
    """Normalised squared singular values of W_Q^h (W_K^h)^T (mean over layers and heads) at each
    probe step. spectra: title -> (steps (P,), singular values (P, L, H, E))."""
    fig, axes = subplots(1, len(spectra), figsize=(4 * len(spectra), 3.5), squeeze=False)
    for ax, (title, (steps, sv)) in zip(axes[0], spectra.items(), strict=True):
        energy = sv**2 / (sv**2).sum(-1, keepdims=True)
        profile = energy.mean((1, 2))  # (P, E)
        colors = plt.cm.viridis(np.linspace(0, 1, len(steps)))
        for p in range(len(steps)):
            ax.plot(np.arange(1, profile.shape[1] + 1), profile[p], color=colors[p], lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("singular value index")
        ax.set_title(title, fontsize=9)
        sm = plt.cm.ScalarMappable(cmap="viridis", norm=plt.Normalize(steps.min(), steps.max()))
        fig.colorbar(sm, ax=ax, label="step")
    axes[0, 0].set_ylabel("normalised sigma^2 of W_Q W_K^T")
    fig.suptitle("Interaction spectrum over training (mean over layers and heads)")
    return fig


def _arm_color(arm: str, arms: list[str]) -> str:
    if arm == "none":
        return "k"
    cmap = plt.get_cmap("tab10")
    return cmap(arms.index(arm) % 10)


def by_condition(df: pd.DataFrame, metric: str, ylabel: str, title: str) -> Figure:
    """Layer-mean `metric` against step per intervention condition, min-max band over seeds."""
    fig, ax = subplots(figsize=(7, 4.5))
    rows = df[(df["head"] == -1) & (df["metric"] == metric)]
    arms = sorted(rows["intervention"].unique())
    for arm, g in rows.groupby("intervention"):
        per_run = g.groupby(["step", "run_id"])["value"].mean().unstack("run_id")
        _band(ax, per_run, _arm_color(arm, arms), arm)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig


def control_tracking(df: pd.DataFrame) -> Figure:
    """Achieved controlled spectrum (mean over controlled heads) and its target (dashed), per arm;
    the baseline (`none`) in black. One panel per controlled object."""
    panels = [
        m for m in ("key_weight_participation_ratio", "interaction_rank") if (df["metric"] == f"{m}_target").any()
    ]
    fig, axes = subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4), squeeze=False)
    arms = sorted(df["intervention"].unique())
    for ax, metric in zip(axes[0], panels, strict=False):
        target = df[df["metric"] == f"{metric}_target"]
        controlled = set(target["intervention"]) | {"none"}
        achieved = df[(df["metric"] == metric) & (df["head"] >= 0) & df["intervention"].isin(controlled)]
        for arm, g in achieved.groupby("intervention"):
            s = g.groupby("step")["value"].mean()
            ax.plot(s.index, s.values, color=_arm_color(arm, arms), lw=1.5, label=arm)
        for arm, g in target.groupby("intervention"):
            s = g.groupby("step")["value"].mean()
            ax.plot(s.index, s.values, color=_arm_color(arm, arms), ls="--", lw=1)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{metric} (mean over heads and seeds)")
        ax.legend(fontsize=7)
    fig.suptitle("Controlled spectrum: achieved (solid) and target (dashed)")
    return fig


def dose_response(points: pd.DataFrame, slopes: pd.DataFrame, summary: dict) -> Figure:
    """Attention entropy against log activation PR_K per arm and seed (post-transient means), one
    line per seed: the causal estimate is the mean of these per-seed slopes (`summary`: its mean and
    95% interval, analysis.dose.dose_summary)."""
    fig, ax = subplots(figsize=(6.5, 4.5))
    arms = sorted(points["intervention"].unique())
    fits = slopes.set_index("seed")
    for seed, g in points.groupby("seed"):
        if seed in fits.index and np.isfinite(fits.loc[seed, "slope"]):  # the seed's fit, over its own range
            f = fits.loc[seed]
            xs = np.array([f["x_min"], f["x_max"]])
            ax.plot(xs, f["intercept"] + f["slope"] * xs, color="0.6", lw=0.8, zorder=1)
        for arm, r in g.groupby("intervention"):
            ax.scatter(
                r["log_pr_k"],
                r["entropy"],
                color=_arm_color(arm, arms),
                s=22,
                zorder=2,
                marker="o" if r["in_fit"].iloc[0] else "x",
                label=arm if seed == points["seed"].min() else None,
            )
    ax.set_title(
        f"Dose-response: slope {summary['slope']:.3f} [{summary['low']:.3f}, {summary['high']:.3f}] "
        f"(95% t over {summary['n']} seeds; lines: per-seed fits)",
        fontsize=9,
    )
    ax.set_xlabel("log activation PR_K (post-transient mean, layer mean)")
    ax.set_ylabel(metric_label("attention_entropy"))
    ax.legend(fontsize=7)
    return fig


def loss_curves(metrics: pd.DataFrame, by: str) -> Figure:
    """Validation loss against step, one line per run, coloured by the column `by` (the training
    loss where no run logged a validation loss, as a qkgeom.Probe loop may not)."""
    fig, ax = subplots(figsize=(6, 4))
    split = "valid" if "split" in metrics and (metrics["split"] == "valid").any() else "train"
    val = metrics[metrics["split"] == split] if "split" in metrics else metrics.iloc[:0]
    cmap = plt.cm.tab10
    for i, (key, g) in enumerate(val.groupby(by)):
        for _, r in g.groupby("run_id"):
            ax.plot(r["step"], r["loss"], color=COLORS.get(str(key), cmap(i % 10)), alpha=0.6, lw=1)
        ax.plot([], [], color=COLORS.get(str(key), cmap(i % 10)), label=f"{by}={key}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{'validation' if split == 'valid' else 'training'} loss (nats/token)")
    if len(val):
        ax.legend(fontsize=8)
    ax.set_title("Validation loss" if split == "valid" else "Training loss (no validation loss logged)")
    return fig


def sensitivity(claims: pd.DataFrame, what: str = "Window sensitivity", cols: int = 3) -> Figure:
    """Each claim's value with its 95% interval (over seeds) against the window it was judged in, one
    small panel per claim; claims with no estimate in any window are left out and counted in the title."""
    names = list(dict.fromkeys(claims["claim"]))
    shown = [n for n in names if np.isfinite(claims.loc[claims["claim"] == n, "value"].astype(float)).any()]
    cols = max(1, min(cols, len(shown)))
    rows = max(1, -(-len(shown) // cols))
    fig, axes = subplots(rows, cols, figsize=(4.4 * cols, 2.9 * rows), squeeze=False)
    for ax, name in zip(axes.flat, shown, strict=False):
        c = claims[claims["claim"] == name]
        x = np.arange(len(c))
        v, lo, hi = (c[k].astype(float).to_numpy() for k in ("value", "ci_low", "ci_high"))
        colors = [{"holds": "tab:green", "fails": "tab:red"}.get(x, "tab:gray") for x in c["verdict"]]
        err = np.nan_to_num(np.clip([v - lo, hi - v], 0, None))  # no bar where there is no interval
        ax.errorbar(x, v, yerr=err, fmt="none", ecolor="0.5", capsize=3)
        ax.scatter(x, v, c=colors, zorder=3)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(textwrap.fill(name, 52), fontsize=7, loc="left")
        ax.set_xticks(x, list(c["window"]), fontsize=7, rotation=20, ha="right")
        ax.set_ylabel("estimate, 95% CI", fontsize=8)
    for ax in axes.flat[len(shown) :]:
        fig.delaxes(ax)
    left_out = f"; {len(names) - len(shown)} claims with no estimate left out" if len(shown) < len(names) else ""
    fig.suptitle(f"{what} (green: holds, red: fails, gray: inconclusive{left_out})", fontsize=10)
    return fig


def slope_by_depth(table: pd.DataFrame) -> Figure:
    """Post-transient slopes of PR_Q and PR_K against relative depth, per init and depth: the seed mean
    with the 95% t-interval the analysis wrote (analysis.claims.slope_by_depth)."""
    inits = sorted(table["qk_init"].unique())
    fig, axes = subplots(1, 2, figsize=(10, 3.6), sharex=True)
    for ax, (side, name) in zip(
        axes,
        [("query", metric_label("query_participation_ratio")), ("key", metric_label("key_participation_ratio"))],
        strict=True,
    ):
        for i, init in enumerate(inits):
            for depth, g in table[(table["qk_init"] == init) & (table["side"] == side)].groupby("n_layers"):
                g = g.sort_values("rel")
                yerr = [g["mean"] - g["low"], g["high"] - g["mean"]]
                alpha = 0.5 + 0.5 * depth / table["n_layers"].max()
                ax.errorbar(g["rel"], g["mean"], yerr=yerr, marker="o", ms=3, capsize=2, color=f"C{i}", alpha=alpha,
                            label=f"{init}, depth {depth}")  # fmt: skip
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xlabel="relative depth (0 = first layer, 1 = last)", ylabel=f"{name} slope (PR per run)",
               title=f"Post-transient {name} slope by depth")  # fmt: skip
    axes[1].legend(fontsize=7)
    return fig


def layer_trajectories(df: pd.DataFrame) -> Figure:
    """One run: PR_Q and PR_K of every layer against step (symlog, from 0), one panel per layer, the
    post-transient window shaded when known."""
    from matplotlib.ticker import MaxNLocator

    rows = df[(df["head"] == -1) & df["metric"].isin(["query_participation_ratio", "key_participation_ratio"])]
    layers = sorted(rows["layer"].unique())
    cols = min(4, len(layers))
    nrows = -(-len(layers) // cols)
    fig, axes = subplots(nrows, cols, figsize=(3.4 * cols, 2.8 * nrows), squeeze=False, sharex=True)
    for ax in axes.flat[len(layers) :]:
        ax.set_visible(False)
    for ax, layer in zip(axes.flat, layers, strict=False):
        for side in ("query", "key"):
            s = rows[(rows["layer"] == layer) & (rows["metric"] == f"{side}_participation_ratio")].sort_values("step")
            ax.plot(s["step"], s["value"], "-o", ms=2, color=COLORS[side], label=f"PR_{side[0].upper()}")
        if "transient_end" in rows:
            ax.axvspan(rows["transient_end"].iloc[0], rows["step"].max(), color="0.9", zorder=0)
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(left=0)
        ax.yaxis.set_major_locator(MaxNLocator(5))
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("step")
    axes.flat[0].set_ylabel("participation ratio")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("PR_Q and PR_K per layer (grey: post-transient window)", fontsize=10)
    return fig


def energy_ranks(table: pd.DataFrame, title: str) -> Figure:
    """Weight rank against realised rank per head (analysis.spectral.energy_ranks): components carrying
    90% of the energy of W_Q W_K^T (o) and of the row-centred logits on data (x) along the heads,
    and their ratio weights / data."""
    t = table.sort_values(["layer", "head"]).reset_index(drop=True)
    x = np.arange(len(t))
    fig, axes = subplots(1, 2, figsize=(12, 3.6))
    axes[0].plot(x, t["weight_rank90"], "o", ms=4, label="W_Q W_K^T (weights)")
    axes[0].plot(x, t["data_rank90"], "x", ms=5, label="row-centred Q K^T on data")
    axes[0].set_ylabel("components for 90% of the energy")
    axes[1].bar(x, t["ratio"], color="tab:gray")
    axes[1].axhline(1, color="k", lw=0.8)
    axes[1].set_ylabel("ratio weights / data")
    for ax in axes:
        starts = [i for i in range(len(t)) if i == 0 or t["layer"][i] != t["layer"][i - 1]]
        ax.set_xticks(starts, [f"L{t['layer'][i]}" for i in starts])
        ax.set_xlabel("head (grouped by layer)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return fig


def spectral_lifecycle(life: pd.DataFrame, title: str) -> Figure:
    """alpha (top) and PR (bottom) of each projection's whole matrix per layer over training, one column
    per matrix (analysis.spectral.lifecycle); the heavy-tail reading of the 2026 lifecycle study."""
    mats = [m for m in ("W_Q", "W_K", "W_V", "W_O") if m in set(life["matrix"])]
    fig, axes = subplots(2, len(mats), figsize=(3.4 * len(mats), 5.6), squeeze=False, sharex=True)
    layers = sorted(life["layer"].unique())
    cmap = plt.get_cmap("viridis", max(2, len(layers)))
    for j, m in enumerate(mats):
        part = life[life["matrix"] == m]
        for li in layers:
            rows = part[part["layer"] == li].sort_values("step")
            for i, col in enumerate(("alpha", "pr")):
                axes[i, j].plot(rows["step"], rows[col], color=cmap(li), lw=1.2, label=f"layer {li}")
        axes[0, j].set_title(m)
        axes[1, j].set_xlabel("step")
        for i in range(2):
            axes[i, j].set_xscale("symlog", linthresh=10)
    axes[0, 0].set_ylabel("alpha (whole matrix)")
    axes[1, 0].set_ylabel("PR (mean over heads)")
    axes[0, -1].legend(fontsize=7)
    fig.suptitle(title)
    return fig


def matched_dose(table: pd.DataFrame) -> Figure:
    """Causal v4 (analysis.matched.dose_table): per controlled layer, each arm's entropy change against
    its delivered dose, both vs the sham, as points with the 95% intervals the analysis wrote."""
    layers = sorted(table["layer"].unique())
    fig, axes = subplots(1, len(layers), figsize=(4.2 * len(layers), 4), squeeze=False, sharey=True)
    arms = sorted(table["arm"].unique())
    for ax, layer in zip(axes[0], layers, strict=True):
        for r in table[table["layer"] == layer].itertuples(index=False):
            xerr = [[r.dose - r.dose_low], [r.dose_high - r.dose]] if np.isfinite(r.dose_low) else None
            yerr = [[r.entropy - r.entropy_low], [r.entropy_high - r.entropy]] if np.isfinite(r.entropy_low) else None
            ax.errorbar(r.dose, r.entropy, xerr=xerr, yerr=yerr, fmt="o", color=_arm_color(r.arm, arms), label=r.arm,
                        capsize=3)  # fmt: skip
        ax.axhline(0, color="0.7", lw=0.8)
        ax.axvline(0, color="0.7", lw=0.8)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("delivered dose: log per-head PR_K, arm / sham")
    axes[0][0].set_ylabel("attention entropy, arm - sham (nats)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Matched logit scale: entropy against delivered key-spectrum dose", fontsize=10)
    return fig


def verdict_seeds(rows: pd.DataFrame, colours: dict[str, str]) -> Figure:
    """Every verdict row's per-seed values (dots) with the mean and 95% interval the analysis wrote (bar),
    one line a row. Rows have their own units, so each line is scaled by its largest |per-seed value|:
    what the eye reads is the sign, the spread and a lone seed far from the rest (a skewed row, whose
    t-interval covers less than its 95%: docs/GLOSSARY.md, "Coverage, measured"). rows: label, values
    (an array a row), value, ci_low, ci_high, verdict; colours: verdict -> the band behind its line."""
    fig, ax = subplots(figsize=(10, 1.2 + 0.3 * len(rows)))
    rng = np.random.default_rng(0)  # the dots' vertical jitter only
    reach = 1.15
    for i, r in enumerate(rows.itertuples(index=False)):
        scale = float(np.max(np.abs(r.values))) or 1.0
        reach = max([reach, *(abs(b) / scale for b in (r.ci_low, r.ci_high) if np.isfinite(b))])
        ax.axhspan(i - 0.45, i + 0.45, color=colours.get(r.verdict, "#f4f4f4"), lw=0)
        ax.scatter(r.values / scale, i + rng.uniform(-0.18, 0.18, len(r.values)), s=10, color="0.25", zorder=3)
        if np.isfinite(r.ci_low) and np.isfinite(r.ci_high):
            ax.plot([r.ci_low / scale, r.ci_high / scale], [i, i], color="tab:blue", lw=2.2, zorder=2)
        ax.plot([r.value / scale], [i], "|", color="tab:blue", ms=12, mew=2.2, zorder=4)
    ax.axvline(0, color="0.4", lw=0.8)
    ax.set_yticks(range(len(rows)), [textwrap.shorten(str(s), 90) for s in rows["label"]], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(-min(reach, 3.0) * 1.05, min(reach, 3.0) * 1.05)  # an interval past 3x runs off the edge
    ax.set_xlabel("per seed, scaled by the row's largest |value| (dots); mean and 95% interval (blue); 0 = no effect")
    ax.set_ylabel("verdict row (claim_id · group · window)")
    ax.set_title("Per-seed values behind each verdict (band: the verdict's colour)", fontsize=10)
    return fig
