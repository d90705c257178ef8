"""The written analysis: a markdown report, CSV files and PNG charts of the per-component summaries.

``write_report`` writes into one folder:

- ``norm_analysis.md``: a table per layer kind (SN importance weights; SSN importance weights and choices,
  with a row per SSN layer: the normalizer of its means and of its variances and the iteration each was
  fixed at; DN grouping, with a row per DN layer since they are discrete; MN / MGN gates), each followed
  by its chart;
- ``norm_analysis.csv``: the per-component values, one row per (kind, component, metric);
- ``norm_layers.csv``: the per-layer values, one row per (kind, component, layer, metric);
- ``sn_importance.png``, ``ssn_importance.png``, ``dn_grouping.png``, ``mode_gates.png``: the charts of the
  kinds present.

Nothing here knows about detectron2: the caller passes the records, the function that names a layer's
component and the order of the components.
"""

from __future__ import annotations

import csv
import functools
import os
from collections.abc import Callable, Iterable, Sequence

from .choices import DynamicChoice, SparseSwitchableChoice
from .plots import plot_dynamic, plot_mode_gates, plot_switchable
from .summary import ComponentSummary, Record, kind_of, layer_metrics, summarize

MARKDOWN = "norm_analysis.md"
COMPONENTS_CSV = "norm_analysis.csv"
LAYERS_CSV = "norm_layers.csv"
CHARTS = {
    "SN": "sn_importance.png",
    "SSN": "ssn_importance.png",
    "DN": "dn_grouping.png",
    "MN": "mode_gates.png",
    "MGN": "mode_gates.png",
}
_PLOTTERS = {
    "sn_importance.png": plot_switchable,
    "ssn_importance.png": functools.partial(plot_switchable, kind="SSN"),
    "dn_grouping.png": plot_dynamic,
    "mode_gates.png": plot_mode_gates,
}


def write_report(
    records: Iterable[Record],
    component_of: Callable[[str], str],
    output_dir: str,
    *,
    components: Sequence[str] = (),
    title: str = "Learned normalization",
    notes: Sequence[str] = (),
) -> list[str]:
    """Write the report of ``records`` into ``output_dir`` (created if needed); returns the paths written,
    the markdown first. ``notes`` are paragraphs put under the title (where the model came from, ...)."""
    records = list(records)
    summaries = summarize(records, component_of, components)
    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.join(output_dir, name) for name in (MARKDOWN, COMPONENTS_CSV, LAYERS_CSV)]
    charts = []
    for chart in dict.fromkeys(CHARTS[s.kind] for s in summaries if s.metrics):
        _PLOTTERS[chart](summaries, os.path.join(output_dir, chart))
        charts.append(chart)
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write(markdown(summaries, records, title=title, notes=notes, charts=charts))
    _write_csv(paths[1], ["kind", "component", "layers", "metric", "value"], component_rows(summaries))
    _write_csv(paths[2], ["kind", "component", "layer", "metric", "value"], layer_rows(records, component_of))
    return paths + [os.path.join(output_dir, chart) for chart in charts]


def component_rows(summaries: Sequence[ComponentSummary]) -> list[list]:
    return [[s.kind, s.component, s.layers, metric, value] for s in summaries for metric, value in s.metrics.items()]


def layer_rows(records: Sequence[Record], component_of: Callable[[str], str]) -> list[list]:
    return [
        [kind_of(r), component_of(r.layer), r.layer, metric, value]
        for r in records
        for metric, value in layer_metrics(r).items()
    ]


def _write_csv(path: str, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def markdown(
    summaries: Sequence[ComponentSummary],
    records: Sequence[Record],
    *,
    title: str,
    notes: Sequence[str] = (),
    charts: Sequence[str] = (),
) -> str:
    sections = [f"# {title}", *notes]
    if not summaries:
        sections.append("The model has no SN, SyncSN, SSN, SyncSSN, DN, MN or MGN layer: nothing to analyse.")
    kinds = {s.kind for s in summaries}
    if "SN" in kinds:
        sections.append(_switchable_section(summaries, "sn_importance.png" in charts))
    if "SSN" in kinds:
        sections.append(_sparse_section(summaries, records, "ssn_importance.png" in charts))
    if "DN" in kinds:
        sections.append(_dynamic_section(summaries, records, "dn_grouping.png" in charts))
    if kinds & {"MN", "MGN"}:
        sections.append(_mode_section(summaries, "mode_gates.png" in charts))
    return "\n\n".join(sections) + "\n"


def _number(value: float) -> str:
    return f"{value:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _switchable_section(summaries: Sequence[ComponentSummary], chart: bool) -> str:
    rows = []
    for s in summaries:
        if s.kind == "SN":
            values = [s.metrics[f"{p}_{stat}"] for p in ("mean", "var") for stat in ("IN", "LN", "BN")]
            rows.append([s.component, str(s.layers), *map(_number, values)])
    header = ["component", "SN layers", "μ: IN", "μ: LN", "μ: BN", "σ²: IN", "σ²: LN", "σ²: BN"]
    text = (
        "## Switchable Normalization: importance weights\n\n"
        "softmax(mean_weight) and softmax(var_weight) averaged over the SN layers of each component, as in the "
        "SN paper's Figs. 1c, 3 and 4 (a layer without the BN branch counts with BN weight 0; 1/3 each is "
        "the initial value).\n\n" + _table(header, rows)
    )
    return text + ("\n\n![SN importance weights](sn_importance.png)" if chart else "")


def _sparse_section(summaries: Sequence[ComponentSummary], records: Sequence[Record], chart: bool) -> str:
    rows = []
    for s in summaries:
        if s.kind == "SSN":
            values = [s.metrics[f"{p}_{stat}"] for p in ("mean", "var") for stat in ("IN", "LN", "BN")]
            fixed = [_number(s.metrics["mean_fixed"]), _number(s.metrics["var_fixed"])]
            rows.append([s.component, str(s.layers), *map(_number, values), *fixed])
    header = ["component", "SSN layers", "μ: IN", "μ: LN", "μ: BN", "σ²: IN", "σ²: LN", "σ²: BN", "μ fixed", "σ² fixed"]
    layers = [
        [
            r.layer,
            str(r.channels),
            _chosen(r.mean_choice, r.mean_fixed_at, r.mean_weights),
            _chosen(r.var_choice, r.var_fixed_at, r.var_weights),
            f"{r.radius:.3f}",
        ]
        for r in records
        if isinstance(r, SparseSwitchableChoice)
    ]
    text = (
        "## Sparse Switchable Normalization: choices\n\n"
        "The importance weights (SparsestMax at each layer's radius, one-hot once fixed) averaged over the SSN "
        "layers of each component, and the share of layers whose means and variances are fixed to one "
        "normalizer.\n\n" + _table(header, rows)
    )
    text += "\n\n" + ("![SSN importance weights](ssn_importance.png)\n\n" if chart else "")
    per_layer = "Per layer: the normalizer of the means and of the variances, and the iteration each became one-hot "
    per_layer += "(free ones: their weights IN / LN / BN):\n\n"
    return text + per_layer + _table(["layer", "channels", "means", "variances", "radius"], layers)


def _chosen(choice: str | None, fixed_at: int | None, weights: dict[str, float]) -> str:
    if choice is None:
        return "free: " + " / ".join(_number(weights.get(s, 0.0)) for s in ("IN", "LN", "BN"))
    return f"{choice} (iteration {fixed_at})" if fixed_at is not None else f"{choice} (iteration unknown)"


def _dynamic_section(summaries: Sequence[ComponentSummary], records: Sequence[Record], chart: bool) -> str:
    rows = []
    for s in summaries:
        if s.kind == "DN":
            shares = [_number(s.metrics[name]) for name in ("IN", "GN", "LN", "pools_batch", "strided")]
            rows.append([s.component, str(s.layers), *shares, f"{s.metrics['median_groups']:g}"])
    header = ["component", "DN layers", "IN", "GN", "LN", "pools batch", "strided", "median groups"]
    layers = [
        [
            r.layer,
            str(r.channels),
            str(r.num_groups),
            str(r.group_size),
            r.channel_pooling,
            "yes" if r.contiguous else "no",
            "yes" if r.pools_batch else "no",
        ]
        for r in records
        if isinstance(r, DynamicChoice)
    ]
    layer_header = ["layer", "channels", "groups", "group size", "grouping", "contiguous", "pools batch"]
    text = (
        "## Dynamic Normalization: selected pooling\n\n"
        "Share of the DN layers of each component whose hard gates group the channels as IN (a group per "
        "channel), GN or LN (one group), that pool the batch (BN-like statistics), and whose groups are "
        "strided channel sets instead of contiguous blocks.\n\n" + _table(header, rows)
    )
    text += "\n\n" + ("![DN grouping](dn_grouping.png)\n\n" if chart else "")
    return text + "Per layer:\n\n" + _table(layer_header, layers)


def _mode_section(summaries: Sequence[ComponentSummary], chart: bool) -> str:
    rows = []
    for s in summaries:
        if s.kind in ("MN", "MGN"):
            if not s.metrics:
                rows.append([s.component, s.kind, str(s.layers), "not observed", "–", "–"])
                continue
            modes = " / ".join(_number(v) for name, v in s.metrics.items() if name.startswith("mode_"))
            rows.append(
                [
                    s.component,
                    s.kind,
                    str(s.layers),
                    modes,
                    _number(s.metrics["entropy"]),
                    _number(s.metrics["dominant"]),
                ]
            )
    header = ["component", "kind", "layers", "mean gate probability per mode", "entropy / log K", "largest probability"]
    text = (
        "## Mode Normalization: gates\n\n"
        "Gate assignments observed on the inputs (MN: one per sample; MGN: one per sample and channel), "
        "averaged over the observed layers of each component: the mean probability of each mode, the "
        "normalized entropy (0: each assignment picks one mode; 1: uniform) and the mean largest "
        "probability.\n\n" + _table(header, rows)
    )
    return text + ("\n\n![Mode gates](mode_gates.png)" if chart else "")
