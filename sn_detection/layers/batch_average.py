"""The SN paper's "batch average" (Switchable Normalization, Sec. 2.1, Inference) for a whole model: a
torch-only utility in the manner of fvcore's ``update_bn_stats``.

SN's BN branch, and every other statistic pooled over the batch, needs population statistics at test
time. The paper does not keep a moving average for them: it freezes the network, feeds it a number of
training minibatches in training mode, and averages the statistics those minibatches produce.
``update_batch_average(model, batches, num_batches)`` does exactly that for every module of a model with
batch-dependent test statistics:

- our layers (SN, SyncSN, DN, MN, BNSR) through their protocol ``start_batch_average()`` /
  ``finish_batch_average()`` (``running.RunningMoments``): in between, training-mode forwards pool exact
  batch statistics instead of moving the running ones, and ``finish`` stores the statistics of all
  those batches together;
- PyTorch's BatchNorm (``nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm,
  detectron2's NaiveSyncBatchNorm), which has no such protocol: a forward pre-hook pools each input's
  per-channel sums into the same ``MomentAccumulator`` (from fp32 ``var_mean``, summed in float64),
  the momentum is 0 meanwhile so the running buffers do not move, and at the end ``running_mean`` /
  ``running_var`` become the mean and *unbiased* variance of all the pooled values (BatchNorm's own
  convention) with ``num_batches_tracked`` as it was. Unlike fvcore's precise BN (a cumulative average
  of per-batch means and variances) this is exact for batches of different sizes and includes the
  spread between batch means.

Which modules take part: those with the protocol and running buffers, or a BatchNorm with
``track_running_stats``, that are in training mode once the model is (a frozen layer of ours stays in
evaluation mode and is skipped, as is a BatchNorm deliberately kept in evaluation mode; detectron2's
FrozenBatchNorm2d has no batch statistics at all). A module is started on its first call, empty inputs
included (an empty batch adds nothing); one that pooled no value (a head that got no RoIs in any batch,
or was never called) keeps its statistics, with a warning.

Guarantees: no gradients are computed and no parameter changes; the model's and every submodule's
training flag are restored; if a forward raises, every statistic is restored to its value before the
call. Nothing runs, and no batch is read, when the model has no such module. The caller decides what a
batch is and wraps the call in whatever context its model needs (detectron2's models log to an
``EventStorage`` in training mode: ``sn_detection.d2.hooks`` provides one).

Several processes: each process averages the batches it is given. SyncSN all-reduces its statistics
inside the layer, so every process stores the same, global, average, also a process whose own inputs to
the layer were all empty (starting on the first call, not on the first non-empty input, makes every
process pool the same all-reduced sums). Every other layer stores its own process's average, as
detectron2's PreciseBN does; this matches what those layers see in training.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .map_passes import stat_dtype
from .running import MomentAccumulator, group_sums, running_target

logger = logging.getLogger(__name__)


def _has_protocol(module: nn.Module) -> bool:
    return callable(getattr(module, "start_batch_average", None)) and callable(
        getattr(module, "finish_batch_average", None)
    )


def has_batch_statistics(module: nn.Module) -> bool:
    """True for a module whose test-time statistics a batch average recomputes: one of our layers with
    running buffers (SN without its BN branch has none) or a BatchNorm that tracks running statistics,
    and that is not frozen."""
    if getattr(module, "frozen", False):
        return False
    if _has_protocol(module):
        return any(True for _ in module.buffers(recurse=False))
    return isinstance(module, _BatchNorm) and module.track_running_stats


def batch_statistics_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` for which ``has_batch_statistics`` holds."""
    return [m for m in model.modules() if has_batch_statistics(m)]


class _LayerAverage:
    """Batch average of a layer with the start/finish protocol, started on its first call."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.started = False
        self._saved = {name: b.detach().clone() for name, b in module.named_buffers(recurse=False)}

    def observe(self, x: Tensor) -> None:
        if not self.started:
            self.module.start_batch_average()
            self.started = True

    def finish(self) -> bool:
        """Stores the pooled statistics; False if there were none (the layer keeps its own)."""
        if not self.started:
            return False
        try:
            self.module.finish_batch_average()
        except RuntimeError:
            # nothing was pooled: only empty inputs (on every process, for SyncSN)
            return False
        return True

    def abort(self) -> None:
        """Leave the averaging state and put the buffers back as they were."""
        if self.started:
            try:
                self.module.finish_batch_average()
            except RuntimeError:  # started, but the failing forward recorded nothing
                pass
        with torch.no_grad():
            for name, value in self._saved.items():
                getattr(self.module, name).copy_(value)


class _BatchNormAverage:
    """Batch average of a PyTorch BatchNorm: pools the exact per-channel sums of its inputs.

    From its first input on (empty ones included: BatchNorm counts those in ``num_batches_tracked``), the
    momentum is 0, so the training-mode forwards normalize with batch statistics as usual but leave the
    running buffers as they are (this also covers momentum None); momentum and ``num_batches_tracked``
    are restored at the end."""

    def __init__(self, module: _BatchNorm):
        self.module = module
        self._saved = None
        self._sums = MomentAccumulator()

    def observe(self, x: Tensor) -> None:
        if self._saved is None:
            self._saved = (self.module.momentum, self.module.num_batches_tracked.clone())
            self.module.momentum = 0.0
        if x.numel() == 0:
            return
        # per-channel moments over every other dimension: one group of x.numel() / C values
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.detach().to(stat_dtype(x)), dim=dims, correction=0)
        self._sums.add(group_sums(mean[None], var[None], x.numel() // x.shape[1]))

    @torch.no_grad()
    def finish(self) -> bool:
        """Stores the statistics of the pooled values; False if no value reached the layer."""
        self.abort()
        try:
            sums = self._sums.pooled()
        except RuntimeError:
            return False
        mean, var = running_target(sums, unbiased=True)
        self.module.running_mean.copy_(mean)
        self.module.running_var.copy_(var)
        return True

    @torch.no_grad()
    def abort(self) -> None:
        """Put momentum and ``num_batches_tracked`` back (the running buffers never moved)."""
        if self._saved is not None:
            self.module.momentum, tracked = self._saved
            self.module.num_batches_tracked.copy_(tracked)
            self._saved = None


def _averager(module: nn.Module):
    return _LayerAverage(module) if _has_protocol(module) else _BatchNormAverage(module)


def update_batch_average(model: nn.Module, batches: Iterable, num_batches: int) -> int:
    """Recompute the batch-dependent test statistics of every module of ``model`` that has them (see the
    module docstring) from ``num_batches`` items of ``batches``, each fed as ``model(batch)`` in training
    mode without gradients.

    Returns the number of batches used: 0 when the model has no such module (nothing is read), fewer
    than ``num_batches`` (with a warning) when the iterable runs out first.
    """
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    modes = {m: m.training for m in model.modules()}
    averagers, handles = {}, []
    try:
        if not model.training:
            model.train()
        averagers = {name: _averager(m) for name, m in model.named_modules() if has_batch_statistics(m) and m.training}
        if not averagers:
            return 0
        for averager in averagers.values():
            handles.append(averager.module.register_forward_pre_hook(_observer(averager)))
        logger.info("Batch average: statistics of %d layers from %d batches", len(averagers), num_batches)
        used = _feed(model, itertools.islice(batches, num_batches))
        if used < num_batches:
            logger.warning("Batch average: the batches ran out after %d of %d", used, num_batches)
    except BaseException:
        for averager in averagers.values():
            averager.abort()
        raise
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    unreached = [name for name, averager in averagers.items() if not averager.finish()]
    if unreached:
        logger.warning("Batch average: no input reached %s; they keep their previous statistics", unreached)
    return used


def _feed(model: nn.Module, batches: Iterable) -> int:
    used = 0
    with torch.no_grad():
        for batch in batches:
            model(batch)
            used += 1
    if used == 0:
        raise ValueError("batch average: no batch was given")
    return used


def _observer(averager) -> Callable:
    def observe(module, args):
        if args and isinstance(args[0], Tensor):
            averager.observe(args[0])

    return observe
