"""Per-layer records of learned normalization, as metrics, and their average per network component.

Like the SN paper's histograms (Sec. 4.1, "Ablation study of importance weights"), a component's value
is the plain average over its layers: every layer counts once, whatever its width. The component of a
layer comes from a function of its name given by the caller (``sn_detection.d2.components`` knows
detectron2's names), so this module does not depend on any model library.

Metrics, all in [0, 1] but DN's median group count:

- SN: ``mean_IN``, ``mean_LN``, ``mean_BN``, ``var_IN``, ``var_LN``, ``var_BN``: the importance weights of
  the means and of the variances (a layer without the BN branch counts with BN weight 0).
- SSN: SN's six, then ``mean_fixed``, ``var_fixed``: the share of layers whose means (variances) are fixed
  to one normalizer. Per layer also ``mean_fixed_at``, ``var_fixed_at``, the iteration each became one-hot
  where known, which are not averaged.
- DN: ``IN``, ``GN``, ``LN``: the share of layers whose channel grouping is that (see
  ``DynamicChoice.channel_pooling``); ``pools_batch``: the share pooling the batch; ``strided``: the share
  whose groups are not contiguous blocks; ``median_groups``: the median number of channel groups.
- MN, MGN: ``mode_1`` ... ``mode_K``: the mean gate probability of each mode; ``entropy``: the mean
  normalized entropy of an assignment; ``dominant``: the mean largest gate probability. Averaged over
  the layers whose gates were observed (``ModeGates.assignments`` > 0); a component none of whose
  layers was observed has no metrics. Modes are numbered per layer: mode 1 of two layers are unrelated
  modes, so ``mode_k`` mostly tells how balanced the modes are.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .choices import STATISTICS, DynamicChoice, ModeGates, SparseSwitchableChoice, SwitchableChoice

Record = SwitchableChoice | SparseSwitchableChoice | DynamicChoice | ModeGates
KINDS = ("SN", "SSN", "DN", "MN", "MGN")
_PER_LAYER_ONLY = ("mean_fixed_at", "var_fixed_at")  # iterations: not averaged over a component


@dataclass(frozen=True)
class ComponentSummary:
    """The averaged metrics of the ``layers`` layers of one kind (``KINDS``) in a component."""

    kind: str
    component: str
    layers: int
    metrics: dict[str, float]


def kind_of(record: Record) -> str:
    if isinstance(record, SparseSwitchableChoice):
        return "SSN"
    if isinstance(record, SwitchableChoice):
        return "SN"
    if isinstance(record, DynamicChoice):
        return "DN"
    return record.kind


def layer_metrics(record: Record) -> dict[str, float]:
    """The metrics of one layer (see the module docstring); {} for mode gates never observed."""
    if isinstance(record, (SwitchableChoice, SparseSwitchableChoice)):
        metrics = {
            **{f"mean_{s}": record.mean_weights.get(s, 0.0) for s in STATISTICS},
            **{f"var_{s}": record.var_weights.get(s, 0.0) for s in STATISTICS},
        }
        if isinstance(record, SparseSwitchableChoice):
            metrics.update(
                mean_fixed=float(record.mean_choice is not None), var_fixed=float(record.var_choice is not None)
            )
            for name in _PER_LAYER_ONLY:
                if getattr(record, name) is not None:
                    metrics[name] = float(getattr(record, name))
        return metrics
    if isinstance(record, DynamicChoice):
        pooling = record.channel_pooling
        return {
            **{name: float(pooling == name) for name in ("IN", "GN", "LN")},
            "pools_batch": float(record.pools_batch),
            "strided": float(not record.contiguous),
            "groups": float(record.num_groups),
        }
    if not record.assignments:
        return {}
    modes = {f"mode_{k + 1}": p for k, p in enumerate(record.mode_probabilities)}
    return {**modes, "entropy": record.entropy, "dominant": record.dominant_probability}


def summarize(
    records: Iterable[Record], component_of: Callable[[str], str], components: Sequence[str] = ()
) -> list[ComponentSummary]:
    """One ``ComponentSummary`` per (kind, component) that has layers, ordered by kind (``KINDS``), then
    by ``components`` (components not in it come after, in order of appearance)."""
    groups: dict[tuple[str, str], list[Record]] = {}
    for record in records:
        groups.setdefault((kind_of(record), component_of(record.layer)), []).append(record)
    rank = {name: i for i, name in enumerate(components)}
    order = sorted(groups, key=lambda key: (KINDS.index(key[0]), rank.get(key[1], len(rank))))
    return [
        ComponentSummary(kind, component, len(groups[kind, component]), _average(groups[kind, component]))
        for kind, component in order
    ]


def _average(records: list[Record]) -> dict[str, float]:
    per_layer = [m for m in map(layer_metrics, records) if m]
    names = [name for name in dict.fromkeys(n for metrics in per_layer for n in metrics) if name not in _PER_LAYER_ONLY]
    averaged = {}
    for name in names:
        values = [metrics[name] for metrics in per_layer if name in metrics]
        if name == "groups":
            averaged["median_groups"] = float(statistics.median(values))
        else:
            averaged[name] = sum(values) / len(values)
    return averaged
