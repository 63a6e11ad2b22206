"""Figures of checkpoint families and token ladders: tidy DataFrames in, matplotlib Figures out (no
files, no state), as report.plots, whose layout helpers they share."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from qkgeom.metrics import metric_label
from qkgeom.probing.archs import one_site
from qkgeom.report.plots import COLORS, subplots


def family_contrast(geometry: pd.DataFrame, revisions: pd.DataFrame) -> Figure:
    """PR_Q - PR_K per layer against training step (symlog) across a checkpoint family, per site."""
    g = geometry[
        (geometry["metric"] == "participation_ratio_contrast") & (geometry["head"] == -1) & (geometry["step"] >= 0)
    ]
    sites = sorted(g["site"].unique())
    fig, axes = subplots(1, len(sites), figsize=(6 * len(sites), 4), squeeze=False)
    flagged = set(revisions.loc[revisions["flag"] != "", "revision"])
    for ax, site in zip(axes[0], sites, strict=True):
        sub = g[g["site"] == site]
        cmap = plt.cm.viridis(np.linspace(0, 1, sub["layer"].nunique()))
        for color, (layer, x) in zip(cmap, sub.groupby("layer"), strict=True):
            s = x.groupby("step")["value"].mean()
            ax.plot(s.index, s.values, "-o", ms=3, color=color, label=f"layer {layer}")
        dup = sub[sub["revision"].isin(flagged)].groupby("step")["value"].mean()
        if len(dup):
            ax.plot(dup.index, dup.values, "rx", ms=8, label="duplicate weights")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("step")
        ax.set_ylabel("PR_Q - PR_K (layer)")
        ax.set_title(f"site: {site}")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("Paired contrast across the checkpoint family")
    return fig


def model_heads(geometry: pd.DataFrame, revision: str) -> Figure:
    """One model (one revision): layer PR_Q and PR_K, per-head normalised attention entropy, and
    interaction rank against entropy across heads (the gauge-invariant link)."""
    g = geometry[geometry["revision"] == revision]
    site = "post_rotary" if (g["site"] == "post_rotary").any() else "none"
    act = g[g["site"] == site]
    fig, axes = subplots(1, 3, figsize=(15, 4))
    layer = act[act["head"] == -1].pivot_table(index="layer", columns="metric", values="value")
    for side in ("query", "key"):
        axes[0].plot(layer.index, layer[f"{side}_participation_ratio"], "-o", ms=3, color=COLORS[side],
                     label=f"PR_{side[0].upper()}")  # fmt: skip
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("participation ratio (layer)")
    axes[0].legend()
    ent = act[(act["metric"] == "attention_entropy_normalised") & (act["head"] >= 0)]
    grid = ent.pivot_table(index="layer", columns="head", values="value")
    im = axes[1].imshow(grid.to_numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, origin="lower")
    fig.colorbar(im, ax=axes[1], label="normalised attention entropy")
    axes[1].set_xlabel("head")
    axes[1].set_ylabel("layer")
    heads = g[g["head"] >= 0]
    ir = one_site(heads[heads["metric"] == "interaction_rank"]).set_index(["layer", "head"])["value"]
    en = ent.set_index(["layer", "head"])["value"]
    both = pd.concat([ir.rename("ir"), en.rename("en")], axis=1, join="inner")
    sc = axes[2].scatter(both["ir"], both["en"], c=both.index.get_level_values("layer"), cmap="viridis", s=12)
    fig.colorbar(sc, ax=axes[2], label="layer")
    axes[2].set_xlabel("interaction rank (W_Q W_K^T)")
    axes[2].set_ylabel("normalised attention entropy")
    fig.suptitle(f"{revision}: per layer and per head (site {site})")
    return fig


def family_seeds_contrast(fam: pd.DataFrame, early_max_step: int) -> Figure:
    """A family study: PR_Q - PR_K (token level) against step per layer and for the layer mean, one
    thin line per seed and their mean, the early window shaded."""
    g = fam[(fam["metric"] == "participation_ratio_contrast") & (fam["head"] == -1) & (fam["step"] >= 0)]
    g = g[g["site"] == one_site(g)["site"].iloc[0]]
    panels = [(f"layer {layer}", x) for layer, x in g.groupby("layer")] + [("layer mean", g)]
    fig, axes = subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), sharey=True, squeeze=False)
    for ax, (title, x) in zip(axes[0], panels, strict=True):
        per_seed = x.groupby(["step", "seed"])["value"].mean().unstack("seed")
        ax.plot(per_seed.index, per_seed.to_numpy(), color="0.6", lw=0.8)
        ax.plot(per_seed.index, per_seed.mean(axis=1), "-o", color="tab:purple", ms=3, lw=1.6, label="mean over seeds")
        ax.axvspan(0, early_max_step, color="tab:green", alpha=0.08, label=f"early window (step <= {early_max_step})")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(left=0)
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=9)
    axes[0, 0].set_ylabel(metric_label("participation_ratio_contrast"))
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Paired contrast over each seed's checkpoint family (gray: seeds)", fontsize=10)
    return fig


def family_windows(table: pd.DataFrame, registered: int) -> Figure:
    """A family study's family_windows.csv: F1 (early trend) and F2 (early - late decay) with their 95%
    intervals against where the early window ends, the layer mean and each layer; the registered end marked."""
    fig, axes = subplots(1, 2, figsize=(11, 3.6))
    groups = list(dict.fromkeys(table["group"]))
    for ax, (claim, title) in zip(axes, (("F1", "F1 early trend (Spearman rho)"),
                                         ("F2", "F2 decay: early rho - late rho")), strict=True):  # fmt: skip
        rows = table[table["claim"] == claim]
        for i, group in enumerate(groups):
            g = rows[rows["group"] == group].sort_values("early_max_step")
            x = g["early_max_step"] * (1 + 0.03 * (i - (len(groups) - 1) / 2))  # side by side, not on top
            err = [g["value"] - g["ci_low"], g["ci_high"] - g["value"]]
            mean = group == "layer mean"
            ax.errorbar(x, g["value"], yerr=err, marker="o", ms=4 if mean else 3, capsize=2, lw=2 if mean else 0.9,
                        color="k" if mean else f"C{i}", label=group)  # fmt: skip
        ax.axhline(0, color="k", lw=0.5)
        ax.axvline(registered, color="tab:green", lw=1, ls="--", label=f"registered end ({registered})")
        ax.set_xscale("log")
        ticks = sorted(table["early_max_step"].unique())
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("early window ends at step")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("Claim 4 with the early window ending elsewhere (exploratory; 95% intervals over seeds)", fontsize=10)
    return fig


def heads_link(fam: pd.DataFrame, seeds: pd.DataFrame, statistic: str, per_step: pd.DataFrame) -> Figure:
    """A family study: the across-heads Spearman of interaction rank with attention entropy at each
    revision (per seed, and the analysis' mean with its 95% interval: per_step has step, value,
    ci_low, ci_high, the F5 rows), and the per-head scatter at three revisions."""
    fig, axes = subplots(1, 4, figsize=(16, 3.6))
    rho = seeds[(seeds["statistic"] == statistic) & (seeds["step"] > 0)]
    ax = axes[0]
    ax.scatter(rho["step"], rho["rho"], s=8, color="0.6", label="seeds")
    per_step = per_step.sort_values("step")
    ax.plot(per_step["step"], per_step["value"], "-o", ms=3, color="tab:purple", label="mean")
    ax.fill_between(per_step["step"], per_step["ci_low"], per_step["ci_high"], color="tab:purple", alpha=0.2, lw=0,
                    label="95% CI")  # fmt: skip
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(left=0)
    ax.set_xlabel("step")
    ax.set_ylabel("Spearman rho across heads")
    ax.set_title("interaction rank vs entropy, per revision", fontsize=9)
    ax.legend(fontsize=7)
    heads = fam[(fam["head"] >= 0) & (fam["step"] > 0)]
    steps = sorted(heads["step"].unique())
    for ax, step in zip(axes[1:], [steps[0], steps[len(steps) // 2], steps[-1]], strict=True):
        at = heads[heads["step"] == step]
        ir = one_site(at[at["metric"] == "interaction_rank"]).set_index(["seed", "layer", "head"])["value"]
        en = one_site(at[at["metric"] == "attention_entropy"]).set_index(["seed", "layer", "head"])["value"]
        both = pd.concat([ir.rename("ir"), en.rename("en")], axis=1, join="inner").reset_index()
        ax.scatter(both["ir"], both["en"], c=both["layer"], cmap="viridis", s=14)
        ax.ticklabel_format(useOffset=False)
        ax.set_xlabel("interaction rank (head)")
        ax.set_ylabel(metric_label("attention_entropy"))
        ax.set_title(f"step {step}: heads of every seed (colour: layer)", fontsize=9)
    return fig


def ladder_slopes(summary: pd.DataFrame, metric: str = "PR_K") -> Figure:
    """A token ladder (analysis.ladder.local_slope_summary): per layer, the slope of `metric` per
    doubling of steps in the windows [s/8, s/4], [s/4, s/2], [s/2, s] of each run, against the tokens
    seen at the window's middle; one line per budget, 95% t-bands over seeds. If the layer profile
    flips with tokens, the lines continue one another; if it flips with the LR schedule, each budget
    repeats the same shape at its own scale."""
    layers = sorted(summary["layer"].unique())
    fig, axes = subplots(1, len(layers), figsize=(3.2 * len(layers), 3.0), squeeze=False, sharey=True)
    budgets = sorted(summary["budget_m"].unique())
    cmap = plt.get_cmap("viridis")
    for ax, layer in zip(axes[0], layers, strict=True):
        for i, b in enumerate(budgets):
            g = summary[(summary["layer"] == layer) & (summary["budget_m"] == b)].sort_values("tokens")
            color = cmap(i / max(1, len(budgets) - 1))
            ax.plot(g["tokens"] / 1e6, g["mean"], "o-", color=color, lw=1.5, ms=3, label=f"{b:g} M")
            ax.fill_between(g["tokens"] / 1e6, g["low"], g["high"], color=color, alpha=0.2, lw=0)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("tokens seen (M)")
    span = summary["mean"].abs().max()
    if np.isfinite(span) and span > 0:  # bands at small n can be wide: keep the lines readable
        axes[0][0].set_ylim(-2 * span, 2 * span)
    axes[0][0].set_ylabel(f"{metric} slope per doubling of steps")
    axes[0][-1].legend(title="budget", fontsize=7, title_fontsize=7)
    return fig
