"""Gate statistics of Mode Normalization (MN) and Mode Group Normalization (MGN) layers on real inputs.

Their gates are functions of each input (Mode Normalization paper, Alg. 1 and 3), so unlike SN's
weights they can only be observed on data. ``GateRecorder`` attaches a forward pre-hook to every MN /
MGN layer of a model and, for each input, recomputes the gates from the layer's own ``gate`` parameters:

- MN: one assignment per sample, g_n = softmax(Psi(s_n)), s_n the sample's per-channel means (C,);
- MGN: one assignment per (sample, channel), g_nc = softmax(Psi(s_nc)), s_nc that channel's mean.

The gates are recomputed here with the layer's own ``gate_logits`` rather than read from the layers so
that the layers' forward stays as it is (no extra outputs or state on the hot path); the cost is one mean
over H, W per recorded input, and nothing at all when no recorder is active. Per layer it keeps, over all
assignments seen: the mean gate probability of each mode, the mean entropy of an assignment divided by
log K (0: every assignment picks one mode; 1: uniform; 0 for K = 1), and the mean largest probability (how
decisive assignments are).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn

from ..layers import ModeGroupNorm2d, ModeNorm2d
from ..layers.map_passes import stat_dtype
from .choices import ModeGates, mode_layers


def gate_probabilities(module: nn.Module, x: Tensor) -> Tensor:
    """The gate assignments of ``module`` (ModeNorm2d or ModeGroupNorm2d) for input ``x``, as
    (assignments, K): (N, K) for MN, (N * C, K) for MGN; in the layers' statistics dtype (fp32 or
    wider), without gradients."""
    if not isinstance(module, (ModeNorm2d, ModeGroupNorm2d)):
        raise TypeError(f"gate_probabilities needs a ModeNorm2d or ModeGroupNorm2d, got {type(module).__name__}")
    with torch.no_grad():
        logits = module.gate_logits(x.detach().to(stat_dtype(x)).mean(dim=(2, 3)))
        return torch.softmax(logits, dim=-1).reshape(-1, module.num_modes)


class _GateSums:
    """Running sums over the assignments one layer has seen."""

    def __init__(self, num_modes: int):
        self.count = 0
        self.probabilities = torch.zeros(num_modes, dtype=torch.float64)
        self.entropy = 0.0
        self.dominant = 0.0

    def add(self, gates: Tensor) -> None:
        gates = gates.double()
        num_modes = gates.shape[1]
        entropy = -(gates * gates.clamp_min(1e-30).log()).sum(1)
        self.count += gates.shape[0]
        self.probabilities += gates.sum(0)
        self.entropy += float(entropy.sum()) / math.log(num_modes) if num_modes > 1 else 0.0
        self.dominant += float(gates.max(1).values.sum())


class GateRecorder:
    """Records the gate statistics of every MN / MGN layer of ``model`` while active::

    with GateRecorder(model) as recorder:
        model(batch)
    recorder.results()   # a ModeGates per layer, in module order
    """

    def __init__(self, model: nn.Module):
        self._layers = mode_layers(model)
        self._sums = {name: _GateSums(m.num_modes) for name, m in self._layers.items()}
        self._handles = []

    def start(self) -> GateRecorder:
        """Attach the forward pre-hooks (also done by ``with``)."""
        for name, module in self._layers.items():
            self._handles.append(module.register_forward_pre_hook(self._observer(name)))
        return self

    def stop(self) -> None:
        """Remove the hooks; the statistics recorded so far stay available."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> GateRecorder:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _observer(self, name: str):
        def observe(module, args):
            if args and isinstance(args[0], Tensor) and args[0].numel() > 0:
                self._sums[name].add(gate_probabilities(module, args[0]))

        return observe

    def results(self) -> list[ModeGates]:
        return [self._result(name, module) for name, module in self._layers.items()]

    def _result(self, name: str, module: nn.Module) -> ModeGates:
        sums = self._sums[name]
        kind = "MN" if isinstance(module, ModeNorm2d) else "MGN"
        record = ModeGates(name, kind, module.num_channels, module.num_modes)
        if sums.count == 0:
            return record
        return replace(
            record,
            assignments=sums.count,
            mode_probabilities=tuple((sums.probabilities / sums.count).tolist()),
            entropy=sums.entropy / sums.count,
            dominant_probability=sums.dominant / sums.count,
        )
