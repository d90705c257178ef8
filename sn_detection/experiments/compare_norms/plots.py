"""Figures of the norm comparison: box and mask AP per setting (mean, std error bars, every seed as a
dot) and the learning curves (total_loss against iteration, one panel per setting, one line per seed).

Figures are drawn on matplotlib's ``Figure`` directly and written with the Agg renderer: no pyplot, no
display, and no change to the process's global matplotlib backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from .report import SettingSummary
from .runs import RunResult

_TASKS = {"box AP": ("box_AP", "tab:blue"), "mask AP": ("mask_AP", "tab:orange")}


def _save(figure: Figure, path: str) -> None:
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)


def plot_ap(summaries: Sequence[SettingSummary], results: Sequence[RunResult], path: str) -> None:
    """Bars of the mean box and mask AP per setting with ± one std (none for a single run) and the
    seeds' own values as dots."""
    figure = Figure(figsize=(max(6.0, 1.1 * len(summaries) + 2), 4.5))
    axes = figure.add_subplot(1, 1, 1)
    positions = np.arange(len(summaries))
    width = 0.38
    for i, (label, (column, colour)) in enumerate(_TASKS.items()):
        offset = (i - 0.5) * width
        means = [s.mean[column] for s in summaries]
        errors = [0.0 if math.isnan(s.std[column]) else s.std[column] for s in summaries]
        axes.bar(positions + offset, means, width, yerr=errors, capsize=4, label=label, color=colour, alpha=0.75)
        for position, summary in zip(positions, summaries):
            seeds = [r.metrics[column] for r in results if r.setting == summary.setting]
            axes.scatter([position + offset] * len(seeds), seeds, s=12, color="black", zorder=3)
    axes.set_xticks(positions, [s.setting for s in summaries])
    axes.set_xlabel("norm setting (backbone/FPN + heads)")
    axes.set_ylabel("COCO AP")
    axes.grid(axis="y", alpha=0.3)
    axes.legend()
    axes.set_title("AP per norm setting: mean ± std over seeds, dots are single runs")
    _save(figure, path)


def plot_loss_curves(curves: dict[str, dict[int, list[tuple[int, float]]]], path: str) -> None:
    """``curves``: setting -> seed -> (iteration, total_loss); one panel per setting, same axes."""
    settings = list(curves)
    columns = min(4, max(len(settings), 1))
    rows = math.ceil(len(settings) / columns) or 1
    figure = Figure(figsize=(3.6 * columns, 2.8 * rows))
    first = None
    for i, setting in enumerate(settings):
        axes = figure.add_subplot(rows, columns, i + 1, sharex=first, sharey=first)
        first = first or axes
        for seed, curve in sorted(curves[setting].items()):
            if curve:
                iterations, losses = zip(*curve)
                axes.plot(iterations, losses, linewidth=1, marker=".", markersize=3, label=f"seed {seed}")
        axes.set_title(setting)
        axes.set_xlabel("iteration")
        axes.set_ylabel("total_loss")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle("Training loss (detectron2's 20-iteration median) per norm setting")
    _save(figure, path)
