"""What makes a figure hard to read at a glance, found on the drawn figure (issue 57): text boxes that
overlap (titles, the figure's title, axis labels, legends), axes that hold data but no tick labels on
one of their axes or no y-axis label, and axes that hold nothing. The report's figures are checked in
tests/report/test_report.py; `layout_problems` works on any matplotlib figure."""

from __future__ import annotations

from itertools import combinations

from matplotlib.figure import Figure


def _has_data(ax) -> bool:
    return bool(ax.lines or ax.collections or ax.patches or ax.images)


def _axes_problems(ax, name: str) -> list[str]:
    """An axes that holds nothing, or holds data without tick labels on an axis or a y-axis label."""
    if not _has_data(ax):
        return [f"{name}: empty (no lines, markers, bars or images)"]
    problems = [
        f"{name}: no {axis} tick labels"
        for axis, labels in (("x", ax.get_xticklabels()), ("y", ax.get_yticklabels()))
        if not any(t.get_visible() and t.get_text() for t in labels)
    ]
    return problems + ([] if ax.get_ylabel() else [f"{name}: no y-axis label"])


def _text_boxes(ax, name: str, renderer) -> list[tuple[str, object]]:
    """(what, window extent) of the axes' visible titles, axis labels and legend."""
    boxes = [
        (f"{name} {text.get_text()!r}", text.get_window_extent(renderer))
        for text in (ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label)  # noqa: SLF001
        if text.get_visible() and text.get_text()
    ]
    legend = ax.get_legend()
    if legend is not None and legend.get_visible():
        boxes.append((f"{name} legend", legend.get_window_extent(renderer)))
    return boxes


def layout_problems(fig: Figure) -> list[str]:
    """One line per problem of the drawn `fig` (empty: none). Colorbars are exempt from the axis
    checks (they have one axis by design); an axes turned off (ax.axis("off")) is exempt too."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems: list[str] = []
    boxes = []  # (what, window extent) of every text box that must not overlap another
    title = fig._suptitle  # noqa: SLF001 - matplotlib keeps the figure title here
    if title is not None and title.get_visible() and title.get_text():
        boxes.append(("figure title", title.get_window_extent(renderer)))
    for i, ax in enumerate(fig.axes):
        if not ax.get_visible() or not ax.axison or hasattr(ax, "_colorbar"):
            continue
        name = f"axes {i}" + (f" ({ax.get_title()!r})" if ax.get_title() else "")
        problems += _axes_problems(ax, name)
        if _has_data(ax):
            boxes += _text_boxes(ax, name, renderer)
    for (a, box_a), (b, box_b) in combinations(boxes, 2):
        if box_a.overlaps(box_b):
            problems.append(f"{a} overlaps {b}")
    return problems


def tidy(fig: Figure) -> Figure:
    """The report's last pass over a figure before it is drawn: tick labels on every panel (a shared
    axis hides the inner ones), each panel's y-axis label from a labelled panel of its row where it
    has none, panels that hold nothing removed, and constrained layout so no title overlaps a panel."""
    for ax in list(fig.axes):
        if not ax.get_visible() or not ax.axison or hasattr(ax, "_colorbar"):
            continue
        if not _has_data(ax):
            fig.delaxes(ax)
            continue
        ax.tick_params(labelbottom=True, labelleft=True)
        if not ax.get_ylabel() and (spec := ax.get_subplotspec()) is not None:
            row = [o for o in fig.axes if o.get_subplotspec() is not None and o.get_ylabel()
                   and o.get_subplotspec().rowspan == spec.rowspan]  # fmt: skip
            if row:
                ax.set_ylabel(row[0].get_ylabel(), fontsize=row[0].yaxis.label.get_fontsize())
    fig.set_layout_engine("constrained")
    return fig
