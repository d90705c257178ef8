"""Bar charts of the per-component summaries, in the manner of the SN paper's Figs. 1c, 3 and 4 (one bar
per statistic, grouped by part of the network, means and variances apart), and line charts of their
evolution during training.

Figures are drawn on matplotlib's ``Figure`` directly and written with the Agg renderer: no pyplot, no
display, and no change to the process's global matplotlib backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from .choices import STATISTICS
from .summary import ComponentSummary

# One colour per normalizer, the same in every figure.
COLOURS = {"IN": "tab:orange", "LN": "tab:green", "BN": "tab:blue", "GN": "tab:purple"}
# Metrics that are not shares or probabilities, left out of the [0, 1] charts.
_UNBOUNDED = ("median_groups",)


def _grouped_bars(axes, labels: Sequence[str], series: dict[str, list[float]], colours: dict[str, str]) -> None:
    """Bars of each series side by side at each label."""
    positions = np.arange(len(labels))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        axes.bar(positions + offset, values, width, label=name, color=colours.get(name))
    axes.set_xticks(positions, labels)
    axes.set_ylim(0, 1)
    axes.grid(axis="y", alpha=0.3)


def _stacked_bars(axes, labels: Sequence[str], series: dict[str, list[float]], colours: dict[str, str]) -> None:
    positions = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for name, values in series.items():
        axes.bar(positions, values, 0.6, bottom=bottom, label=name, color=colours.get(name))
        bottom += np.asarray(values)
    axes.set_xticks(positions, labels)
    axes.set_ylim(0, 1)


def _save(figure: Figure, path: str) -> None:
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)


def plot_switchable(summaries: Sequence[ComponentSummary], path: str, kind: str = "SN") -> None:
    """SN's (or SSN's: ``kind``) importance weights of IN, LN and BN per component, for the means (top) and
    variances (bottom)."""
    rows = [s for s in summaries if s.kind == kind]
    labels = [f"{s.component}\n({s.layers})" for s in rows]
    figure = Figure(figsize=(max(6.0, 0.9 * len(rows) + 2), 6.5))
    for i, (prefix, title) in enumerate((("mean", "means $\\mu$"), ("var", "variances $\\sigma^2$"))):
        axes = figure.add_subplot(2, 1, i + 1)
        series = {s: [row.metrics[f"{prefix}_{s}"] for row in rows] for s in STATISTICS}
        _grouped_bars(axes, labels, series, COLOURS)
        axes.axhline(1 / 3, color="grey", linestyle=":", linewidth=1)
        axes.set_ylabel("importance weight")
        axes.set_title(f"{kind} importance weights of the {title} (layers per component in brackets)")
        axes.legend(loc="upper right", ncol=3, fontsize="small")
    _save(figure, path)


def plot_dynamic(summaries: Sequence[ComponentSummary], path: str) -> None:
    """DN: the share of layers grouping channels as IN / GN / LN (left) and pooling the batch (right)."""
    rows = [s for s in summaries if s.kind == "DN"]
    labels = [f"{s.component}\n({s.layers})" for s in rows]
    figure = Figure(figsize=(max(8.0, 1.2 * len(rows) + 3), 4.5))
    grouping = figure.add_subplot(1, 2, 1)
    _stacked_bars(grouping, labels, {p: [row.metrics[p] for row in rows] for p in ("IN", "GN", "LN")}, COLOURS)
    grouping.set_ylabel("share of DN layers")
    grouping.set_title("channel grouping")
    grouping.legend(loc="upper right", fontsize="small")
    batch = figure.add_subplot(1, 2, 2)
    _grouped_bars(batch, labels, {"pools the batch": [row.metrics["pools_batch"] for row in rows]}, {})
    batch.set_title("batch pooling (BN-like)")
    _save(figure, path)


def plot_mode_gates(summaries: Sequence[ComponentSummary], path: str) -> None:
    """MN / MGN: mean gate probability of each mode (stacked, left) and how decisive the gates are
    (normalized entropy and largest probability, right), per kind and component."""
    rows = [s for s in summaries if s.kind in ("MN", "MGN") and s.metrics]
    labels = [f"{s.kind} {s.component}\n({s.layers})" for s in rows]
    num_modes = max((sum(name.startswith("mode_") for name in s.metrics) for s in rows), default=0)
    modes = [f"mode_{k + 1}" for k in range(num_modes)]
    figure = Figure(figsize=(max(8.0, 1.2 * len(rows) + 3), 4.5))
    probabilities = figure.add_subplot(1, 2, 1)
    _stacked_bars(probabilities, labels, {m: [row.metrics.get(m, 0.0) for row in rows] for m in modes}, {})
    probabilities.set_ylabel("mean gate probability")
    probabilities.set_title("mode usage")
    probabilities.legend(loc="upper right", fontsize="small")
    decisiveness = figure.add_subplot(1, 2, 2)
    series = {name: [row.metrics[name] for row in rows] for name in ("entropy", "dominant")}
    _grouped_bars(decisiveness, labels, series, {})
    decisiveness.set_title("normalized entropy, largest probability")
    decisiveness.legend(loc="upper right", fontsize="small")
    _save(figure, path)


def plot_evolution(history: Sequence[tuple[int, Sequence[ComponentSummary]]], kind: str, path: str) -> None:
    """One panel per component of ``kind``, one line per metric, over the iterations of ``history``. The
    vertical axes fit the values (not [0, 1]): weights that moved little in a short training stay visible."""
    components = list(dict.fromkeys(s.component for _, summaries in history for s in summaries if s.kind == kind))
    columns = min(3, max(len(components), 1))
    figure = Figure(figsize=(4.5 * columns, 3.2 * math.ceil(len(components) / columns) + 0.5))
    for i, component in enumerate(components):
        axes = figure.add_subplot(math.ceil(len(components) / columns), columns, i + 1)
        for metric, points in _series(history, kind, component).items():
            iterations, values = zip(*points)
            style = "--" if metric.startswith("var_") else "-"
            colour = COLOURS.get(metric.split("_")[-1] if kind in ("SN", "SSN") else metric)
            axes.plot(iterations, values, style, label=metric, color=colour)
        axes.set_title(component)
        axes.set_xlabel("iteration")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="x-small")
    figure.suptitle(f"{kind} during training")
    _save(figure, path)


def _series(history, kind: str, component: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for iteration, summaries in history:
        for summary in summaries:
            if summary.kind == kind and summary.component == component:
                for metric, value in summary.metrics.items():
                    if metric not in _UNBOUNDED:
                        series.setdefault(metric, []).append((iteration, value))
    return series
