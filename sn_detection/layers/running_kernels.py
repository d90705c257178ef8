"""The running-statistics rule of ``running`` (momentum, the mean where a row has values, the variance where
it has more than one, Bessel's correction, MN's mixture) as Triton helpers, for the kernels that move a
layer's running statistics inside their statistics kernel (``switchable``, ``dynamic``, ``mode``,
``skewness``): no launch of their own.

A kernel's programs (a 1-D grid) each call ``running_factor`` once, which counts the batch in
``num_batches_tracked`` (program 0) and gives the factor, then ``store_running_moments`` for the rows and
channels they own.
"""

from __future__ import annotations

from .triton_kernels import tl, triton

if triton is not None:

    @triton.jit
    def running_factor(tracked_ptr, momentum, counted):
        # the factor of this batch (module docstring); ``counted``: 1 if the batch had values, else 0
        if tl.program_id(0) == 0:
            tl.store(tracked_ptr, tl.load(tracked_ptr) + counted)
        return momentum

    @triton.jit
    def store_running_moments(
        running_mean_ptr, running_var_ptr, offsets, mask, mean, var, count, factor, step,
        UNBIASED: tl.constexpr, MIXTURE: tl.constexpr,
    ):
        # The running statistics at ``offsets`` (where ``mask``) moved towards a batch's ``mean`` and biased
        # ``var`` of ``count`` values per row (a scalar, or broadcast to the offsets), in mean's dtype, as
        # ``running.update_running_moments``. ``step``: mean - running_mean where the caller pools it more
        # accurately than that difference of two rounded means (MN), else None.
        old_mean = tl.load(running_mean_ptr + offsets, mask=mask, other=0.0).to(mean.dtype)
        old_var = tl.load(running_var_ptr + offsets, mask=mask, other=0.0).to(mean.dtype)
        if step is None:
            delta = mean - old_mean
        else:
            delta = step
        if UNBIASED:
            var = var * (count / tl.maximum(count - 1, 1))
        new_var = old_var + factor * (var - old_var)
        if MIXTURE:
            new_var += factor * (1 - factor) * delta * delta
            var_seen = count > 0
        else:
            var_seen = count > 1
        # tl.where rather than a narrower mask: the count may be a loaded scalar, which the interpreter does
        # not combine with a mask
        tl.store(running_mean_ptr + offsets, tl.where(count > 0, old_mean + factor * delta, old_mean), mask=mask)
        tl.store(running_var_ptr + offsets, tl.where(var_seen, new_var, old_var), mask=mask)
