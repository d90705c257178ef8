"""The running-statistics rule of ``running`` (momentum or the cumulative average, the mean where a row has
values, the variance where it has more than one, Bessel's correction, MN's mixture) as Triton helpers,
for the kernels that move a layer's running statistics inside their statistics kernel (``switchable``,
``dynamic``, ``mode``, ``skewness``): no launch of their own.

A kernel's programs (a 1-D grid) each call ``running_factor`` once, which counts the batch in
``num_batches_tracked`` and gives the factor, then ``store_running_moments`` for the rows and channels
they own.

``momentum=None`` reaches the kernels as None, which Triton compiles as a constant: the cumulative
average's factor is 1 / num_batches_tracked, counting this batch, which every program needs while one of
them counts the batch. Programs may run in any order and cannot wait for each other, so each takes a
ticket, one atomic add of 2^32 to the counter: the low 32 bits of what it reads are the batches counted
before (every program reads the same), the high bits how many programs took a ticket before it, and the
last program takes the tickets back and counts the batch. (With a number, program 0 counts the batch.)
"""

from __future__ import annotations

from .kernel_launch import tl, triton

if triton is not None:
    _TICKET = tl.constexpr(1 << 32)

    @triton.jit
    def running_factor(tracked_ptr, momentum, counted):
        # the factor of this batch (module docstring), called once by every program of the grid; ``counted``:
        # 1 if the batch had values, else 0
        if momentum is None:
            ticket = tl.atomic_add(tracked_ptr, _TICKET)
            programs_before = ticket // _TICKET
            if programs_before == tl.num_programs(0) - 1:
                tl.atomic_add(tracked_ptr, counted - (programs_before + 1) * _TICKET)
            factor = 1.0 / tl.maximum(ticket % _TICKET + counted, 1).to(tl.float32)
        else:
            if tl.program_id(0) == 0:
                tl.store(tracked_ptr, tl.load(tracked_ptr) + counted)
            factor = momentum
        return factor

    @triton.jit
    def store_running_moments(
        running_mean_ptr,
        running_var_ptr,
        offsets,
        mask,
        mean,
        var,
        count,
        factor,
        step,
        UNBIASED: tl.constexpr,
        MIXTURE: tl.constexpr,
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
