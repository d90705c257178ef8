"""Running statistics of the layers whose test-time statistics pool training batches, and the SN paper's
batch average: ``RunningMoments``, the extension of ``base.NormBase`` for SN / SyncSN (the BN branch), DN
(batch pooling), MN (per-mode estimates) and BNSR, as torch's ``_BatchNorm`` extends its ``_NormBase``.

A layer hands each training batch's statistics to ``_track`` as ``MomentSums``: per channel (per mode and
channel for MN, whose samples count for a mode in proportion to their gates) the total weight, the
weighted sum of x and the weighted sum of x^2. Sums rather than means, so that batches, processes and
modes of any size combine exactly (law of total variance); in float64, so that E[x^2] - E[x]^2 keeps
fp32 accuracy even where a channel's mean is 1e4 times its spread.

Buffers, with torch's names: ``running_mean``, ``running_var`` (shape (C,), or (K, C) for MN) and
``num_batches_tracked``. Updates follow torch's momentum convention, m = ``momentum``, or with
``momentum=None`` torch's cumulative average, m = 1 / num_batches_tracked (counting this batch):

    running_mean = (1 - m) running_mean + m mean
    running_var  = (1 - m) running_var  + m var                                     (SN, DN, BNSR)
    running_var  = (1 - m) running_var  + m var + m (1 - m) (mean - running_mean)^2  (MN)

The MN line is the paper's Alg. 2 (momentum on E[x] and E[x^2]) written for the variance: it is the
variance of that mixture, computed without subtracting two large second moments. A batch without values
(an empty batch, a mode no sample chose) changes nothing, and one with a single value per channel (one
image of 1x1 maps) only the mean, except for MN: one value has no spread, and its variance of 0 would
pull an average of batch variances towards 0 until evaluation divides by sqrt(eps) (torch's BatchNorm
refuses such a batch); MN's estimate, the variance of the mixture, takes the value's distance instead.
``running_var`` is the biased variance unless the class sets ``unbiased_running_var`` (BNSR, like
BatchNorm). ``num_batches_tracked`` counts the batches that had values. This rule is written once for
the torch path (``update_running_moments``) and once for the Triton kernels (``kernels``: the running update), which
move the running statistics inside their own statistics kernels.

The batch average (SN paper, Sec. 2.1, Inference): between ``start_batch_average()`` and
``finish_batch_average()`` training-mode forwards add their sums to a float64 ``MomentAccumulator``
instead of moving the running statistics, and ``finish`` stores the statistics of all those batches as
of one batch (``num_batches_tracked`` is left alone; a channel or mode that received no value keeps its
statistics). ``sn_detection.layers.batch_average`` runs it over a whole model.

State dicts of version 1 (``_version``) load: a missing ``num_batches_tracked`` (DN's and MN's at
version 1) is added, and a ``running_sq_mean`` (MN's E[x^2] at version 1) becomes ``running_var``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .base import NormBase
from .fused import is_replaying

NO_STATISTICS = (
    "batch average has no statistics: run forwards in training mode on non-empty batches between "
    "start_batch_average() and finish_batch_average()"
)


class MomentSums(NamedTuple):
    """Weighted sufficient statistics per channel (and mode), float64: ``count`` (S) the total weight,
    ``total`` (S + (C,)) the weighted sum of x, ``total_sq`` the weighted sum of x^2; S is () or (K,)."""

    count: Tensor
    total: Tensor
    total_sq: Tensor


def _per_row(values: Tensor, target: Tensor) -> Tensor:
    """``values`` of shape S (a count or a mask per row) broadcast against ``target`` of shape S + (C,)."""
    while values.dim() < target.dim():
        values = values.unsqueeze(-1)
    return values


def group_sums(mean: Tensor, var: Tensor, size: int) -> MomentSums:
    """The ``MomentSums`` of groups of ``size`` values each (H * W pixels, say), given by their means and
    biased variances (G, C): for instance the IN statistics of a batch. Differentiable."""
    mean, var = mean.double(), var.double()
    count = torch.full((), float(mean.shape[0] * size), dtype=torch.float64, device=mean.device)
    return MomentSums(count, mean.sum(0) * size, (var + mean.square()).sum(0) * size)


def mode_sums(mean: Tensor, var: Tensor, weights: Tensor) -> MomentSums:
    """The ``MomentSums`` per mode of groups given by their means and biased variances (G, C), group g
    counting for mode k with weight ``weights[g, k]`` (G, K): sums of shape (K,) and (K, C). Differentiable."""
    mean, var, weights = mean.double(), var.double(), weights.double()
    return MomentSums(weights.sum(0), weights.t() @ mean, weights.t() @ (var + mean.square()))


def moments_from_sums(sums: MomentSums, min_count: float = torch.finfo(torch.float64).tiny) -> tuple[Tensor, Tensor]:
    """Mean and biased variance (float64) of pooled sums. The count is clamped at ``min_count`` (by
    default the smallest positive float64), so that an empty set gives zeros rather than NaN.
    Differentiable."""
    count = _per_row(sums.count.clamp(min=min_count), sums.total)
    mean = sums.total / count
    return mean, (sums.total_sq / count - mean.square()).clamp(min=0)


def running_target(sums: MomentSums, unbiased: bool) -> tuple[Tensor, Tensor]:
    """The mean and the variance a running estimate stores for ``sums``: biased, or with Bessel's
    correction (BatchNorm's convention; the variance of a single value is not stored, see ``variance_seen``)."""
    mean, var = moments_from_sums(sums)
    return mean, _stored_variance(var, _per_row(sums.count, var), unbiased)


def _stored_variance(var: Tensor, count: Tensor, unbiased: bool) -> Tensor:
    """The biased variance ``var`` of ``count`` values as a running estimate stores it: as it is, or with
    Bessel's correction."""
    return var * count / (count - 1).clamp(min=1) if unbiased else var


def variance_seen(count: Tensor, mixture: bool) -> Tensor:
    """The rows of a batch of ``count`` values per row whose variance a running estimate takes: those with
    more than one value, as one value has no spread (module docstring); for MN (``mixture``) any with
    values, its estimate being the variance of the mixture of everything seen (to which one value
    contributes its distance from the mean), and its counts gate weights rather than values."""
    return count > 0 if mixture else count > 1


def update_running_moments(
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor,
    mean: Tensor,
    var: Tensor,
    count: Tensor,
    momentum: float | None,
    unbiased: bool,
    mixture: bool,
) -> None:
    """Move the running statistics in place towards a batch's ``mean`` and biased ``var`` (shape S + (C,),
    like the buffers) of ``count`` values (shape S, or ()) per row, by the module docstring's rule: the
    factor ``momentum``, or 1 / num_batches_tracked for None; the mean where a row has values, the variance
    where ``variance_seen``; Bessel's correction with ``unbiased``, the mixture's variance with ``mixture``;
    ``num_batches_tracked`` counts the batch if any row has values. In float64; no value is read on the
    host. ``kernels.store_running_moments`` is the same rule in the kernels."""
    mean, var = mean.double(), var.double()
    count = _per_row(count.double(), mean)
    seen = count > 0
    num_batches_tracked.add_(seen.any().long())
    # torch.where rather than an `if`, and the cumulative factor as a tensor: a count pooled across
    # processes, and num_batches_tracked, live on the device, and reading them would stall the host
    if momentum is None:
        factor = num_batches_tracked.double().clamp(min=1).reciprocal()
    else:
        factor = torch.full((), momentum, dtype=torch.float64, device=mean.device)
    old_mean, old_var = running_mean.double(), running_var.double()
    step = mean - old_mean
    new_var = old_var + factor * (_stored_variance(var, count, unbiased) - old_var)
    if mixture:
        new_var = new_var + factor * (1 - factor) * step.square()
    running_mean.copy_(torch.where(seen, old_mean + factor * step, old_mean))
    running_var.copy_(torch.where(variance_seen(count, mixture), new_var, old_var))


class MomentAccumulator:
    """Exact pooling of ``MomentSums`` over many batches (detached, float64): ``pooled()`` gives the sums
    of the concatenation of everything added."""

    def __init__(self):
        self._sums: MomentSums | None = None

    def add(self, sums: MomentSums) -> None:
        sums = MomentSums(*(s.detach().double() for s in sums))
        self._sums = sums if self._sums is None else MomentSums(*map(torch.add, self._sums, sums))

    def pooled(self) -> MomentSums:
        """The pooled sums; raises a RuntimeError if no value was added."""
        if self._sums is None or not bool((self._sums.count > 0).any()):
            raise RuntimeError(NO_STATISTICS)
        return self._sums


class RunningMoments(NormBase):
    """A norm layer with running statistics and the batch average (module docstring); its options
    include ``momentum`` (a number in [0, 1], or None for the cumulative average).

    A subclass calls ``_register_running_moments(shape)`` in its constructor (or not at all, when a
    configuration has nothing to estimate, like SN without its BN branch: then tracking and the batch
    average do nothing) and ``_track(sums)`` with each training batch's sums."""

    unbiased_running_var = False
    mixture_running_var = False
    __constants__ = ("unbiased_running_var", "mixture_running_var")  # how TorchScript reads class attributes
    _version = 2

    def _register_running_moments(self, shape) -> None:
        self.register_buffer("running_mean", torch.zeros(shape))
        self.register_buffer("running_var", torch.ones(shape))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self._batch_average = None

    def running_buffers(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(running_mean, running_var, num_batches_tracked)``, read from the buffer dict (module attribute
        lookups cost a layer call a measurable share of its host time)."""
        buffers = self._buffers
        return buffers["running_mean"], buffers["running_var"], buffers["num_batches_tracked"]

    def _tracks_running_moments(self) -> bool:
        return "running_mean" in self._buffers

    def reset_parameters(self) -> None:
        """Running statistics reset, affine 1, 0."""
        self.reset_running_stats()
        super().reset_parameters()

    def reset_running_stats(self) -> None:
        """Running mean 0, running variance 1, no batch tracked (torch's BatchNorm convention)."""
        if self._tracks_running_moments():
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def _track(self, sums: MomentSums) -> None:
        """Record a training batch: into the batch average if one is running, else into the running
        statistics with the layer's momentum."""
        if not torch.jit.is_scripting() and is_replaying():
            return
        sums = MomentSums(sums.count.detach(), sums.total.detach(), sums.total_sq.detach())
        if self._batch_average is not None:
            self._batch_average.add(sums)
            return
        mean, var = moments_from_sums(sums)
        update_running_moments(
            self.running_mean,
            self.running_var,
            self.num_batches_tracked,
            mean,
            var,
            sums.count,
            self.momentum,
            self.unbiased_running_var,
            self.mixture_running_var,
        )

    def start_batch_average(self) -> None:
        """From now on, training-mode forwards pool their statistics instead of moving the running ones."""
        if self._tracks_running_moments():
            self._batch_average = MomentAccumulator()
            self.clear_call_plans()  # the fused paths do not pool into it

    def finish_batch_average(self) -> None:
        """Store the statistics of every batch pooled since ``start_batch_average()`` and stop pooling."""
        if not self._tracks_running_moments():
            return
        # leave averaging mode first, so that a failed finish does not leave the layer stuck in it
        accumulator, self._batch_average = self._batch_average, None
        self.clear_call_plans()
        if accumulator is None:
            raise RuntimeError("finish_batch_average() called without start_batch_average()")
        sums = accumulator.pooled()
        mean, var = running_target(sums, self.unbiased_running_var)
        seen = sums.count > 0
        with torch.no_grad():
            self.running_mean.copy_(torch.where(_per_row(seen, mean), mean, self.running_mean.double()))
            var_seen = _per_row(variance_seen(sums.count, self.mixture_running_var), var)
            self.running_var.copy_(torch.where(var_seen, var, self.running_var.double()))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        version = local_metadata.get("version")
        earlier = version is None or version < 2
        if self._tracks_running_moments() and earlier and prefix + "running_mean" in state_dict:
            if prefix + "running_sq_mean" in state_dict and prefix + "running_var" not in state_dict:
                square = state_dict.pop(prefix + "running_sq_mean")
                mean = state_dict[prefix + "running_mean"]
                state_dict[prefix + "running_var"] = (square - mean.square()).clamp(min=0)
            state_dict.setdefault(prefix + "num_batches_tracked", torch.tensor(0, dtype=torch.long))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
