"""The SN paper's batch average as a detectron2 hook: a thin wrapper over the torch-only
``sn_detection.layers.update_batch_average`` (which says what is averaged, and how), in the place of
detectron2's PreciseBN; and SSN's radius schedule (``SparsityRadius``).

The batches are detectron2's training batches; the model's training-mode logging during the extra
forwards goes to a scratch ``EventStorage``, so the trainer's metrics do not see them. The paper does not
say how many minibatches detection used; ``cfg.TEST.BATCH_AVERAGE.NUM_BATCHES`` (per process) sets it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from detectron2.engine import HookBase
from detectron2.engine.hooks import EvalHook, PeriodicCheckpointer
from detectron2.utils.events import EventStorage
from torch import nn

from ..layers import batch_statistics_modules, update_batch_average
from ..layers.sparse_switchable import linear_radius, set_radius, sparse_switchable_layers

logger = logging.getLogger(__name__)


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

    def __init__(self, model: nn.Module, data_loader_factory: Callable[[int], Iterable], num_batches: int, period: int):
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
        with EventStorage():  # receives (and discards) detectron2's training-mode logging
            used = update_batch_average(self._model, self._data_iter, self._num_batches)
        self._batches_read += used
        return used

    def state_dict(self) -> dict:
        return {"batches_read": self._batches_read}

    def load_state_dict(self, state: dict) -> None:
        self._batches_read = state["batches_read"]
        self._data_iter = None


def batch_average_hook(
    model: nn.Module, data_loader_factory: Callable[[int], Iterable], num_batches: int, period: int
) -> BatchAverage | None:
    """``BatchAverage(model, data_loader_factory, num_batches, period)``, or None (with a log line) when
    ``model`` has no module with batch statistics."""
    if not batch_statistics_modules(model):
        logger.info("Batch average is disabled: the model has no layer with batch statistics")
        return None
    return BatchAverage(model, data_loader_factory, num_batches, period)


def build_batch_average_hook(cfg, model: nn.Module, data_loader_factory: Callable) -> BatchAverage | None:
    """The ``BatchAverage`` hook for the yaml config ``cfg``, or None when cfg.TEST.BATCH_AVERAGE.ENABLED
    is off or ``model`` has no module with batch statistics.

    ``data_loader_factory(cfg, start_batch)`` builds a training data loader whose stream starts at its
    batch ``start_batch`` (e.g. ``Trainer.build_train_loader``). It is called on the hook's first run
    with a copy of ``cfg`` with DATALOADER.NUM_WORKERS 0, as DefaultTrainer does for PreciseBN (no worker
    processes kept alive for the whole training), and SEED + 1 when SEED is fixed, so that the stream is
    not a replay of the training loader's. The hook runs with the period of evaluation,
    cfg.TEST.EVAL_PERIOD, and after the last iteration.
    """
    if not cfg.TEST.BATCH_AVERAGE.ENABLED:
        return None
    loader_cfg = cfg.clone()
    loader_cfg.defrost()
    loader_cfg.DATALOADER.NUM_WORKERS = 0
    if loader_cfg.SEED >= 0:
        loader_cfg.SEED += 1
    return batch_average_hook(
        model,
        lambda start_batch: data_loader_factory(loader_cfg, start_batch),
        num_batches=cfg.TEST.BATCH_AVERAGE.NUM_BATCHES,
        period=cfg.TEST.EVAL_PERIOD,
    )


def insert_before_evaluation(hooks: list, hook: HookBase | None) -> list:
    """``hooks`` with ``hook`` placed right before the first PeriodicCheckpointer or EvalHook (the place
    of PreciseBN in DefaultTrainer.build_hooks), or at the end if there is neither; unchanged for None."""
    if hook is None:
        return list(hooks)
    position = next(
        (i for i, h in enumerate(hooks) if isinstance(h, (PeriodicCheckpointer, EvalHook))),
        len(hooks),
    )
    return [*hooks[:position], hook, *hooks[position:]]


class SparsityRadius(HookBase):
    """Sets the radius of SparsestMax in every SSN layer before each iteration: ``start`` before the first,
    rising linearly to ``end`` after the last of ``max_iter`` (the SSN authors' iteration / total, from 0 to
    1), and the iteration, which a layer records where its weights become one-hot. The radius is a buffer of
    each layer, so a checkpoint holds it; a resumed training sets it again from its iteration."""

    def __init__(self, model: nn.Module, max_iter: int, start: float = 0.0, end: float = 1.0):
        self._model = model
        self._max_iter = max_iter
        self._start, self._end = start, end

    def before_step(self):
        iteration = self.trainer.iter
        set_radius(self._model, linear_radius(iteration, self._max_iter, self._start, self._end), iteration)


def radius_hook(model: nn.Module, max_iter: int, start: float = 0.0, end: float = 1.0) -> SparsityRadius | None:
    """``SparsityRadius(model, max_iter, start, end)``, or None when ``model`` has no SSN layer."""
    if not sparse_switchable_layers(model):
        return None
    return SparsityRadius(model, max_iter, start, end)


def build_radius_hook(cfg, model: nn.Module) -> SparsityRadius | None:
    """The ``SparsityRadius`` hook of the yaml config ``cfg`` (SOLVER.SSN_RADIUS over SOLVER.MAX_ITER), or None
    when ``model`` has no SSN layer."""
    return radius_hook(model, cfg.SOLVER.MAX_ITER, *cfg.SOLVER.SSN_RADIUS)
