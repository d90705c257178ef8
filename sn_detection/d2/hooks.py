"""The paper's "batch average" (Switchable Normalization, Sec. 2.1, Inference) as a detectron2 hook.

SN's BN branch, and every other statistic pooled over the batch, needs population statistics at test
time. The paper does not keep a moving average for them: it freezes the network, feeds it a number of
training minibatches in training mode, and averages the statistics those minibatches produce.
``update_batch_average`` does exactly that for every module of a model that has batch-dependent test
statistics:

- our layers (SN, SyncSN, DN, MN, BNSR) through their protocol ``start_batch_average()`` /
  ``finish_batch_average()``: in between, training-mode forwards pool exact batch statistics instead
  of updating the moving average, and ``finish`` stores the statistics of all those batches together;
- PyTorch's BatchNorm (``nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm,
  detectron2's NaiveSyncBatchNorm), which has no such protocol: here a forward pre-hook pools each
  input's per-channel count, sum and sum of squares (from fp32 ``var_mean``, summed in float64), the
  momentum is 0 meanwhile so the running buffers do not move, and at the end ``running_mean`` /
  ``running_var`` become the mean and *unbiased* variance of all the pooled values (the variance
  convention of BatchNorm's own running estimate) and ``num_batches_tracked`` is left as it was. Unlike
  fvcore's precise BN (a cumulative average of per-batch means and variances) this is exact for
  batches of different sizes and includes the spread between batch means.

Which modules take part: those with the protocol or a BatchNorm with ``track_running_stats``, that are
in training mode once the model is (a frozen layer of ours stays in evaluation mode and is skipped, as
is any BatchNorm deliberately kept in evaluation mode; detectron2's FrozenBatchNorm2d has no batch
statistics at all). A module is started on its first call, empty inputs included (an empty batch adds
nothing to the pool); one that pooled no value (a head that got no RoIs in any batch, or was never
called) keeps its statistics, with a warning.

Guarantees: no gradients are computed and no parameter changes; the model's and every submodule's
training flag are restored; detectron2's training-mode logging goes to a scratch ``EventStorage``, so
the trainer's metrics do not see the extra forwards. If a forward raises, every statistic is restored
to its value before the call. Nothing runs, and no batch is read, when the model has no such module.

Several processes: each process averages the batches its own data loader yields. SyncSN all-reduces
its batch statistics inside the layer, so every process stores the same, global, average, also a
process whose own inputs to the layer were all empty: starting on the first call, not on the first
non-empty input, makes every process pool the same all-reduced sums. Every other layer (SN, DN, MN,
BNSR, BatchNorm) stores its own process's average, as detectron2's PreciseBN does. This matches what the
layers see in training, where those layers normalize with per-process statistics.

The paper does not say how many minibatches detection used; ``cfg.TEST.BATCH_AVERAGE.NUM_BATCHES``
(per process) sets it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Iterable, Optional

import torch
from detectron2.engine import HookBase
from detectron2.engine.hooks import EvalHook, PeriodicCheckpointer
from detectron2.utils.events import EventStorage
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..layers.statistics import stat_dtype

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
            # nothing was pooled: only empty inputs (on every process, for SyncSN); the protocol then
            # leaves the statistics as they were
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
    """Batch average of a PyTorch BatchNorm: pools exact per-channel sums of its inputs (float64).

    From its first input on (empty ones included: BatchNorm counts those in ``num_batches_tracked``), the
    momentum is 0, so the training-mode forwards normalize with batch statistics as usual but leave the
    running buffers as they are (this also covers momentum None); momentum and ``num_batches_tracked``
    are restored at the end."""

    def __init__(self, module: _BatchNorm):
        self.module = module
        self._saved = None
        self._count = 0
        self._sum = self._sum_sq = 0.0

    def observe(self, x: Tensor) -> None:
        if self._saved is None:
            self._saved = (self.module.momentum, self.module.num_batches_tracked.clone())
            self.module.momentum = 0.0
        if x.numel() == 0:
            return
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.detach().to(stat_dtype(x)), dim=dims, correction=0)
        count = x.numel() // x.shape[1]
        mean, var = mean.double(), var.double()
        self._count += count
        self._sum = self._sum + count * mean
        self._sum_sq = self._sum_sq + count * (var + mean.square())

    @torch.no_grad()
    def finish(self) -> bool:
        """Stores the statistics of the pooled values; False if no value reached the layer."""
        self.abort()
        if self._count == 0:
            return False
        mean = self._sum / self._count
        var = (self._sum_sq / self._count - mean.square()).clamp(min=0)
        var = var * self._count / max(self._count - 1, 1)
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


def update_batch_average(model: nn.Module, data_loader_iter: Iterable, num_batches: int) -> int:
    """Recompute the batch-dependent test statistics of every module of ``model`` that has them (see
    the module docstring) from ``num_batches`` batches of ``data_loader_iter``, each fed as
    ``model(batch)`` in training mode without gradients.

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
        used = _feed(model, itertools.islice(data_loader_iter, num_batches))
        if used < num_batches:
            logger.warning("Batch average: the data loader ran out after %d of %d batches", used, num_batches)
    except BaseException:
        for averager in averagers.values():
            averager.abort()
        raise
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    unreached = []
    for name, averager in averagers.items():
        if not averager.finish():
            unreached.append(name)
    if unreached:
        logger.warning("Batch average: no input reached %s; they keep their previous statistics", unreached)
    return used


def _feed(model: nn.Module, batches: Iterable) -> int:
    used = 0
    # a scratch EventStorage receives (and discards) detectron2's training-mode logging
    with torch.no_grad(), EventStorage():
        for batch in batches:
            model(batch)
            used += 1
    if used == 0:
        raise ValueError("batch average: the data loader yielded no batch")
    return used


def _observer(averager) -> Callable:
    def observe(module, args):
        if args and isinstance(args[0], Tensor):
            averager.observe(args[0])

    return observe


class BatchAverage(HookBase):
    """Runs ``update_batch_average`` every ``period`` iterations (0: never) and after the last one.

    Like detectron2's PreciseBN, it runs in ``after_step`` and must come before the EvalHook (so that
    evaluation uses the averaged statistics; the final evaluation runs in the EvalHook's
    ``after_train``) and before the PeriodicCheckpointer (so that the checkpoints hold them):
    see ``insert_before_evaluation``. The data loader is built by ``data_loader_factory(start_batch)``
    on the first run and its iterator reused by later runs, so every run sees fresh training batches.

    Its state (saved with the trainer's checkpoints) is the number of batches read so far: a resumed
    training builds the loader from there on, so that it averages the batches an uninterrupted one would.
    """

    def __init__(
        self, model: nn.Module, data_loader_factory: Callable[[int], Iterable], num_batches: int, period: int
    ):
        self._model = model
        self._data_loader_factory = data_loader_factory
        self._num_batches = num_batches
        self._period = period
        self._data_iter = None
        self._batches_read = 0

    def after_step(self):
        next_iter = self.trainer.iter + 1
        if next_iter == self.trainer.max_iter or (self._period > 0 and next_iter % self._period == 0):
            self.update()

    def update(self) -> int:
        """Recompute the statistics now; returns the number of batches used."""
        if self._data_iter is None:
            self._data_iter = iter(self._data_loader_factory(self._batches_read))
        used = update_batch_average(self._model, self._data_iter, self._num_batches)
        self._batches_read += used
        return used

    def state_dict(self) -> dict:
        return {"batches_read": self._batches_read}

    def load_state_dict(self, state: dict) -> None:
        self._batches_read = state["batches_read"]
        self._data_iter = None


def build_batch_average_hook(cfg, model: nn.Module, data_loader_factory: Callable) -> Optional[BatchAverage]:
    """The ``BatchAverage`` hook for ``cfg``, or None when cfg.TEST.BATCH_AVERAGE.ENABLED is off or
    ``model`` has no module with batch statistics.

    ``data_loader_factory(cfg, start_batch)`` builds a training data loader whose stream starts at its
    batch ``start_batch`` (e.g. ``Trainer.build_train_loader``). It is called on the hook's first run
    with a copy of ``cfg`` with DATALOADER.NUM_WORKERS 0, as DefaultTrainer does for PreciseBN (no worker
    processes kept alive for the whole training), and SEED + 1 when SEED is fixed, so that the stream is
    not a replay of the training loader's. The hook runs with the period of evaluation,
    cfg.TEST.EVAL_PERIOD, and after the last iteration.
    """
    if not cfg.TEST.BATCH_AVERAGE.ENABLED:
        return None
    if not batch_statistics_modules(model):
        logger.info("Batch average is disabled: the model has no layer with batch statistics")
        return None
    loader_cfg = cfg.clone()
    loader_cfg.defrost()
    loader_cfg.DATALOADER.NUM_WORKERS = 0
    if loader_cfg.SEED >= 0:
        loader_cfg.SEED += 1
    return BatchAverage(
        model,
        lambda start_batch: data_loader_factory(loader_cfg, start_batch),
        num_batches=cfg.TEST.BATCH_AVERAGE.NUM_BATCHES,
        period=cfg.TEST.EVAL_PERIOD,
    )


def insert_before_evaluation(hooks: list, hook: Optional[HookBase]) -> list:
    """``hooks`` with ``hook`` placed right before the first PeriodicCheckpointer or EvalHook (the place
    of PreciseBN in DefaultTrainer.build_hooks), or at the end if there is neither; unchanged for None."""
    if hook is None:
        return list(hooks)
    position = next(
        (i for i, h in enumerate(hooks) if isinstance(h, (PeriodicCheckpointer, EvalHook))),
        len(hooks),
    )
    return [*hooks[:position], hook, *hooks[position:]]
