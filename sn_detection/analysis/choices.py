"""What each learned normalization layer has chosen, read from its parameters (no forward pass).

- SN / SyncSN (Switchable Normalization, Eq. 4): the importance weights softmax(mean_weight) and
  softmax(var_weight) of the IN, LN and BN statistics, the quantities of the SN paper's Figs. 1c, 3, 4.
  A layer without the BN branch (``use_bn=False``, 2 logits each) has no BN weight.
- SSN / SyncSSN: its importance weights (SparsestMax at the layer's radius, or the one-hot vector of a fixed
  choice: the layer's ``branch_weights``), the normalizer it chose for the means and for the variances where
  fixed, and the iteration each became one-hot (``mean_fixed_at``, ``var_fixed_at``; unknown for weights
  converted from the authors' files).
- DN: the pooling its hard gates select now (``DynamicNorm2d.selected_grouping()``): the number of
  channel groups, whether they are contiguous blocks, whether the batch is pooled.

Both are read either from a built model (``learned_choices``) or from a bare state dict
(``choices_from_state_dict``, e.g. a training checkpoint without its config). For a state dict the
layers are recognised by their parameter names: ``P.mean_weight`` + ``P.var_weight`` is SN, with
``P.mean_fixed`` SSN, ``P.channel_gates`` + ``P.batch_gate`` is DN; the channel count comes from
``P.weight``. Each one is loaded into a fresh layer of its class (strictly, so a malformed entry fails with
the layer's name), so that the values come from the same code as in a model. MN / MGN gates depend on the
input, so they are measured on data (see ``gates``); a state dict only tells where those layers are
(``mode_layers_in_state_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..layers import IDENTITY_KEY, DynamicNorm2d, ModeGroupNorm2d, ModeNorm2d, SparseSwitchableNorm2d, SwitchableNorm2d

# SN's statistics, in the order of its logits.
STATISTICS = ("IN", "LN", "BN")


@dataclass(frozen=True)
class SwitchableChoice:
    """The importance weights of one SN layer: statistic ("IN", "LN", "BN") -> weight, summing to 1."""

    layer: str
    channels: int
    mean_weights: dict[str, float]
    var_weights: dict[str, float]


@dataclass(frozen=True)
class SparseSwitchableChoice:
    """The importance weights of one SSN layer (statistic -> weight), the statistic its means and its variances
    are fixed to (None while free) and the iteration each was fixed at (None where unknown or free)."""

    layer: str
    channels: int
    mean_weights: dict[str, float]
    var_weights: dict[str, float]
    mean_choice: str | None
    var_choice: str | None
    mean_fixed_at: int | None
    var_fixed_at: int | None
    radius: float


@dataclass(frozen=True)
class DynamicChoice:
    """The pooling selected by one DN layer's hard gates."""

    layer: str
    channels: int
    num_groups: int
    group_size: int
    contiguous: bool
    pools_batch: bool

    @property
    def channel_pooling(self) -> str:
        """Which classic norm the channel grouping is: "IN" (a group per channel), "LN" (one group) or
        "GN" (anything between). With batch pooling, "IN" channels are BN's statistics."""
        if self.num_groups == self.channels:
            return "IN"
        return "LN" if self.num_groups == 1 else "GN"


@dataclass(frozen=True)
class ModeGates:
    """The gate statistics of one MN / MGN layer (see ``gates``); ``assignments`` 0 means none was
    observed (then the statistics are None)."""

    layer: str
    kind: str
    channels: int
    num_modes: int
    assignments: int = 0
    mode_probabilities: tuple[float, ...] | None = None
    entropy: float | None = None
    dominant_probability: float | None = None


Choice = SwitchableChoice | SparseSwitchableChoice | DynamicChoice


def switchable_choice(layer: str, module: SwitchableNorm2d) -> SwitchableChoice:
    return SwitchableChoice(
        layer=layer,
        channels=module.num_channels,
        mean_weights=_importance(module.mean_weight),
        var_weights=_importance(module.var_weight),
    )


def sparse_switchable_choice(layer: str, module: SparseSwitchableNorm2d) -> SparseSwitchableChoice:
    with torch.no_grad():
        mean_weights, var_weights = module.branch_weights(torch.float64)
    fixed = [int(module.mean_fixed), int(module.var_fixed)]
    fixed_at = [int(module.mean_fixed_at), int(module.var_fixed_at)]
    return SparseSwitchableChoice(
        layer=layer,
        channels=module.num_channels,
        mean_weights=dict(zip(STATISTICS, mean_weights.tolist())),
        var_weights=dict(zip(STATISTICS, var_weights.tolist())),
        mean_choice=STATISTICS[fixed[0]] if fixed[0] >= 0 else None,
        var_choice=STATISTICS[fixed[1]] if fixed[1] >= 0 else None,
        mean_fixed_at=fixed_at[0] if fixed[0] >= 0 and fixed_at[0] >= 0 else None,
        var_fixed_at=fixed_at[1] if fixed[1] >= 0 and fixed_at[1] >= 0 else None,
        radius=float(module.radius),
    )


def _importance(logits: Tensor) -> dict[str, float]:
    weights = torch.softmax(logits.detach().double(), 0).tolist()
    return dict(zip(STATISTICS, weights))


def dynamic_choice(layer: str, module: DynamicNorm2d) -> DynamicChoice:
    grouping = module.selected_grouping()
    return DynamicChoice(
        layer=layer,
        channels=module.num_channels,
        num_groups=grouping.num_groups,
        group_size=grouping.group_size,
        contiguous=grouping.contiguous,
        pools_batch=grouping.pools_batch,
    )


def learned_choices(model: nn.Module) -> list[Choice]:
    """The choice of every SN (SyncSN), SSN (SyncSSN) and DN layer of ``model``, in module order."""
    choices = []
    for name, module in model.named_modules():
        if isinstance(module, SparseSwitchableNorm2d):
            choices.append(sparse_switchable_choice(name, module))
        elif isinstance(module, SwitchableNorm2d):
            choices.append(switchable_choice(name, module))
        elif isinstance(module, DynamicNorm2d):
            choices.append(dynamic_choice(name, module))
    return choices


def mode_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The MN and MGN layers of ``model`` by name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (ModeNorm2d, ModeGroupNorm2d))}


def choices_from_state_dict(state_dict: Mapping[str, Tensor]) -> list[Choice]:
    """The choice of every SN, SSN and DN layer whose parameters are in ``state_dict``, in key order."""
    choices = []
    switchable, dynamic = SwitchableNorm2d.gate_parameters, DynamicNorm2d.gate_parameters
    for prefix in _prefixes(state_dict, switchable + dynamic):
        if _has(state_dict, prefix, *switchable):
            logits = state_dict[prefix + "mean_weight"]
            if logits.dim() != 1 or len(logits) not in (2, 3):
                raise ValueError(
                    f"{prefix}mean_weight: SN logits must be a vector of 3 ([IN, LN, BN]) or 2 ([IN, LN]) "
                    f"entries, got shape {tuple(logits.shape)}"
                )
            sparse = _has(state_dict, prefix, "mean_fixed")
            module = (SparseSwitchableNorm2d if sparse else SwitchableNorm2d)(
                _channels(state_dict, prefix), use_bn=len(logits) == 3
            )
            read = sparse_switchable_choice if sparse else switchable_choice
            choices.append(read(prefix[:-1], _loaded(module, state_dict, prefix)))
        elif _has(state_dict, prefix, *dynamic):
            module = DynamicNorm2d(_channels(state_dict, prefix))
            choices.append(dynamic_choice(prefix[:-1], _loaded(module, state_dict, prefix)))
    return choices


def mode_layers_in_state_dict(state_dict: Mapping[str, Tensor]) -> list[ModeGates]:
    """The MN / MGN layers in ``state_dict``, as ``ModeGates`` with nothing observed. A mode layer is a
    ``P.gate`` linear map next to ``P.weight``: MN's gate reads all C channel means and the layer keeps
    per-mode running statistics ``P.running_var`` of shape (K, C) (``P.running_sq_mean`` in state dicts
    below version 2, which the layer migrates); MGN's gate reads one channel mean at a time (its weight is
    (K, 1))."""
    layers = []
    for prefix in _prefixes(state_dict, ("gate.weight",)):
        if not _has(state_dict, prefix, "weight", "gate.bias"):
            continue
        if _has(state_dict, prefix, "running_var") or _has(state_dict, prefix, "running_sq_mean"):
            kind = "MN"
        elif state_dict[prefix + "gate.weight"].shape[1:] == (1,):
            kind = "MGN"
        else:
            continue
        channels, num_modes = _channels(state_dict, prefix), state_dict[prefix + "gate.bias"].numel()
        layers.append(ModeGates(prefix[:-1], kind, channels, num_modes))
    return layers


def _prefixes(state_dict: Mapping[str, Tensor], suffixes: tuple[str, ...]) -> list[str]:
    """Distinct "name." prefixes of the keys ending in one of ``suffixes``, in key order."""
    found = {}
    for key in state_dict:
        for suffix in suffixes:
            if key.endswith("." + suffix):
                found.setdefault(key[: -len(suffix)], None)
    return list(found)


def _has(state_dict: Mapping[str, Tensor], prefix: str, *names: str) -> bool:
    return all(prefix + name in state_dict for name in names)


def _channels(state_dict: Mapping[str, Tensor], prefix: str) -> int:
    if prefix + "weight" not in state_dict:
        raise ValueError(f"{prefix}weight is missing: cannot tell the channel count of the layer {prefix[:-1]!r}")
    return state_dict[prefix + "weight"].numel()


def _loaded(module: nn.Module, state_dict: Mapping[str, Tensor], prefix: str) -> nn.Module:
    """``module`` (built with default options) with the layer's tensors; its identity is left out, the
    options being unknown here and immaterial to the gates read."""
    own = {key: state_dict[prefix + key] for key in module.state_dict() if prefix + key in state_dict}
    own.pop(IDENTITY_KEY, None)
    try:
        module.load_state_dict(own)
    except RuntimeError as error:
        layer = type(module).__name__
        raise ValueError(f"the entries of layer {prefix[:-1]!r} do not fit a {layer}: {error}") from None
    return module
