"""The layers whose statistics derive from the instance-norm moments (SN, SyncSN, SSN, DN, MN, MGN):
``MomentNormalizer``, their PyTorch path (``normalize_by_moments``) and the pieces BNSR's shares
(``instance_moments``, ``scale_shift``).

Per-(n, c) statistics: computed once, derived into LN / BN statistics, applied as one scale and shift.
Switchable Normalization (Luo et al., Eq. 5) observes that every statistic it mixes can be derived from
the instance-norm moments of each (sample, channel) over H*W:

    mu_ln  = mean_c mu_in,  var_ln = mean_c (var_in + mu_in^2) - mu_ln^2
    mu_bn  = mean_n mu_in,  var_bn = mean_n (var_in + mu_in^2) - mu_bn^2

so the (N, C, H, W) tensor is only read for the moments and once more for the elementwise output, with a
per-(n, c) ``scale`` and ``shift`` folding the normalization and the affine; everything in between works
on (N, C) summaries. The same holds for DN, MN and MGN. A layer states this once, as its
``scale_and_shift(mean_in, var_in, spatial_size) -> (scale, shift)`` in tensor operations: the paper's
formulation, which is the layer's PyTorch path, its TorchScript and exported forms, and the oracle its
kernels are tested against. The full-size passes are ``map_passes`` (PyTorch) and ``kernels`` (Triton).

Numerics: fp32 as accurate as torch's BatchNorm whatever a channel's mean-to-spread ratio.

- IN moments: accurate whatever the ratio (``map_passes``, ``kernels``).
- Derived statistics never subtract large second moments: the LN variance is Eq. 5 written as the law
  of total variance, pooled BN statistics are float64 sums (``running.MomentSums``).
- The output is centred at the IN mean: y = (x - mu_in) * scale + shift, where ``shift`` is computed
  relative to mu_in (``affine_from_moments`` takes the offset of the normalizing mean from mu_in). The
  folded y = x * scale + shift' would round x * scale, of size |mean| / spread, and lose as many digits.
  BatchNorm's evaluation kernel computes exactly (x - mean) * scale + shift, so the centring is free.

Choices the paper leaves open:

- Variances are *biased* (divide by H*W): the unbiased estimate is NaN for 1x1 maps (a bug of the
  original code).
- Statistics are computed in at least float32 whatever the input dtype (fp16 / bf16 inputs are upcast;
  the output has the input's dtype).

The path of a call is the layer's plan for inputs like x (``base.NormBase.forward``): its kernels
(``fused_plan``: the layer's kernel module, on the kernel path), or None, and the PyTorch path.

The kernel path. A layer's kernel module (``switchable_kernels``, ``dynamic_kernels``, ``mode_kernels``)
runs its (N, C) statistics and their gradients in closed form, between four full-size passes
(``kernels.TritonPasses``), inside the one autograd node of ``fused``:

    forward:   moments(x) -> [mean, var, residual] -> one kernel: [scale, shift] (and the running
               statistics) -> scale_shift(x)
    backward:  centered_dot_and_sum(grad_y, x) -> [D, S] -> one kernel: [p, q] and every parameter's
               gradient -> grad_input(grad_y, x) at the exact mean, mean + residual

where D = sum_HW grad_y (x - mean) and S = sum_HW grad_y per (n, c), each [...] one block of (N, C) rows
(one allocation: ``kernels``), and the closed forms are the derivatives of the layer's small (N, C) graph,
written out by hand for each layer (its kernel module says how). Six launches in all; nothing reads a value
on the host: a training step can be captured in a CUDA graph.

The PyTorch path (``normalize_by_moments``) runs a layer's ``scale_and_shift`` on the IN moments as tensor
operations, differentiated by autograd: many small operations per forward and backward, each a kernel
launch on a GPU, which costs host time whatever it computes. It runs wherever the kernels do not:

- off the kernel path (the CPU, float64, other layouts);
- MN, MGN beyond their largest mode count;
- a running batch average (its sums pool in float64 on the host side of the layer);
- SyncSN across several processes off the kernel path.

It is one autograd node that reads the activation for the moments, differentiates the small (N, C) graph
of ``affine`` with autograd, and writes grad_x once from the closed form of the paper's appendix (Eq. 9),
where autograd's generic formulas would allocate several extra full-size temporaries
(``_NormalizeByMoments``). ``reference_normalize_by_moments`` is the same computation in plain autograd,
the oracle of the tests, and what a backward under create_graph replays (``fused.replayed_gradients``).
"""

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .base import NormBase, check_input, exporting
from .fused import FusedPlan, replayed_gradients
from .kernels import TritonPasses, kernel_path
from .map_passes import (
    TorchPasses,
    as_dtype,
    centred_moments,
    plain_mean,
    plain_moments,
    plain_scale_shift,
    stat_dtype,
)


def passes_for(x: Tensor):
    """The full-size passes over ``x`` for the PyTorch path: ``kernels.TritonPasses(x)`` on the kernel path
    where autograd does not record them (the no-grad forms, the closed-form backward), else
    ``map_passes.TorchPasses`` (under create_graph every pass is plain differentiable tensor code)."""
    if not torch.is_grad_enabled() and kernel_path(x):
        return TritonPasses(x)
    return TorchPasses


class _InstanceMoments(torch.autograd.Function):
    """mean and biased variance of x over H*W, shapes (N, C), by the moments pass (``passes_for``); closed-form
    backward."""

    @staticmethod
    def forward(ctx, x: Tensor):
        mean, var = passes_for(x).moments(x)
        ctx.save_for_backward(x, mean)
        return mean, var

    @staticmethod
    def backward(ctx, grad_mean: Tensor, grad_var: Tensor):
        x, mean = ctx.saved_tensors
        count = max(x.shape[2] * x.shape[3], 1)
        # d mean / dx = 1 / HW and d var / dx = 2 (x - mean) / HW: grad = (x - mean) * p + q
        over = passes_for(x)
        return over.scale_shift(x, over.block_of(2 * grad_var / count, grad_mean / count), over.block_of(mean))


def instance_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """IN statistics of an (N, C, H, W) tensor: mean and biased variance over H*W, each (N, C)."""
    if torch.jit.is_scripting() or exporting():
        mean, var, _ = plain_moments(x)
        return mean, var
    return _InstanceMoments.apply(x)


class _ScaleShift(torch.autograd.Function):
    """y = (x - center) * scale + shift with per-(n, c) scale, shift and center, computed in scale's dtype
    and returned in x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, shift: Tensor, center: Tensor):
        ctx.save_for_backward(x, scale, center)
        over = passes_for(x)
        return over.scale_shift(x, over.block_of(scale, shift), over.block_of(center))

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, scale, center = ctx.saved_tensors
        grad_x = (grad_y * scale[:, :, None, None]).to(x.dtype) if ctx.needs_input_grad[0] else None
        over = passes_for(x)
        dot, total = over.centered_dot_and_sum(grad_y, x, over.block_of(center))
        return grad_x, dot, total, -scale * total


def scale_shift(x: Tensor, scale: Tensor, shift: Tensor, center: Tensor) -> Tensor:
    """(x - center) * scale + shift for an (N, C, H, W) x and (N, C) scale, shift and center, in one pass."""
    if torch.jit.is_scripting() or exporting():
        return plain_scale_shift(x, scale, shift, center)
    return _ScaleShift.apply(x, scale, shift, center)


def affine_from_moments(weight: Tensor, bias: Tensor, offset: Tensor, var_eps: Tensor) -> tuple[Tensor, Tensor]:
    """The scale and shift of weight * (x - mean) / sqrt(var + eps) + bias in the centred form
    (x - mu_in) * scale + shift, given ``offset`` = mean - mu_in, the normalizing mean's offset from the
    IN mean (computed by the caller as a difference of nearby values, so that it keeps its digits), and
    ``var_eps`` = var + eps; weight and bias per channel (``per_channel``)."""
    scale = weight / torch.sqrt(var_eps)
    return scale, bias - offset * scale


# (mean_in, var_in), each (N, C) -> (scale, shift), each broadcastable to (N, C), for the output
# (x - mean_in) * scale + shift: what a normalizer does with IN statistics
AffineFromMoments = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def normalize_by_moments(
    x: Tensor, affine: AffineFromMoments, parameters: Sequence[Tensor], variance: bool = True
) -> Tensor:
    """y = (x - mean_in) * scale + shift with (scale, shift) = affine(IN mean, IN variance of x), for any
    normalizer whose statistics derive from the IN statistics (SN, DN, MN, MGN, GN, ...).

    ``parameters`` are all the tensors ``affine`` differentiates with respect to (the module's
    parameters): they receive their gradients through this call. In training this is one autograd node
    that saves only x and the (N, C) intermediate graph; without gradients it is plain tensor code, and
    with ``variance`` False (an ``affine`` that reads no variance: MN in evaluation) on the PyTorch path
    it reads x once for the means alone, and the variance it passes is 0. ``reference_normalize_by_moments``
    is the same computation in straightforward autograd.
    """
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in parameters)):
        return _NormalizeByMoments.apply(x, affine, *parameters)
    with torch.no_grad():
        over = passes_for(x)
        if variance or over is not TorchPasses:
            mean_in, var_in = over.moments(x)
        else:
            mean_in = plain_mean(x)
            var_in = torch.zeros_like(mean_in)
        scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
        return over.scale_shift(x, over.block_of(scale, shift), over.block_of(mean_in))


class MomentNormalizer(NormBase):
    """A norm layer whose output is (x - mean_in) * scale + shift with its own
    ``scale_and_shift(mean_in, var_in, spatial_size) -> (scale, shift)`` (centred at mean_in): through its
    kernels where it has them (``fused_plan``), else ``normalize_by_moments`` (module docstring)."""

    # whether the layer's evaluation reads the IN variance (MN's does not: its statistics are the running ones,
    # and its gates read the means)
    variance_in_evaluation = True

    def plain_forward(self, x: Tensor) -> Tensor:
        """``plain_moments``, the layer's ``scale_and_shift`` and (x - mean) * scale + shift, in plain
        differentiable operations: what TorchScript compiles and exporters record in training."""
        mean, var, _ = plain_moments(x)
        return plain_scale_shift(x, *self.scale_and_shift(mean, var, x.shape[2] * x.shape[3]), mean)

    @torch.jit.unused
    def autograd_forward(self, x: Tensor, parameters: tuple[Tensor, ...]) -> Tensor:
        """``normalize_by_moments`` with the layer's ``scale_and_shift``; in evaluation the moments (the means
        alone where the layer reads no variance: ``variance_in_evaluation``), ``scale_and_shift`` and one affine
        pass."""
        return normalize_by_moments(x, self._affine(x), parameters, self.training or self.variance_in_evaluation)

    @torch.jit.unused
    def make_call_plan(self, x: Tensor) -> FusedPlan | None:
        check_input(x, self.num_channels)
        if x.numel() == 0 or not (self.training or kernel_path(x)):
            # evaluation off the kernel path: ``normalize_by_moments``, whose no-grad form is the fast moments,
            # the layer's own ``scale_and_shift`` and one affine pass
            return None
        return self.fused_plan(x)

    @torch.jit.unused
    def exported_forward(self, x: Tensor) -> Tensor:
        """The layer as exporters record it (``base.exporting``): in evaluation, ``centred_moments`` and the
        layer's ``scale_and_shift`` on (N, C, 1, 1) statistics, then (x - mean) * scale + shift, all plain
        operations; in training, the plain differentiable forward TorchScript runs."""
        if self.training:
            return self.scripted_forward(x)
        check_input(x, self.num_channels)
        mean, centred, var = centred_moments(x)
        scale, shift = self.scale_and_shift(mean, var, x.shape[2] * x.shape[3])
        return as_dtype(centred * scale + shift, x.dtype)

    @torch.jit.unused
    def fused_plan(self, x: Tensor) -> FusedPlan | None:
        """The layer's kernels for inputs like the non-empty ``x`` (``fused.FusedPlan``), where x is on the kernel
        path (``kernels.kernel_path``) and they apply; None elsewhere, and the PyTorch path runs."""
        return None

    @torch.jit.unused
    def replayed_forward(self, x: Tensor) -> Tensor:
        """The layer's output on x in plain differentiable operations (``reference_normalize_by_moments``):
        what a backward under create_graph differentiates."""
        return reference_normalize_by_moments(x, self._affine(x))

    @torch.jit.unused
    def _affine(self, x: Tensor) -> AffineFromMoments:
        return functools.partial(self.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])


def reference_normalize_by_moments(x: Tensor, affine: AffineFromMoments) -> Tensor:
    """``normalize_by_moments`` by separate reductions and autograd through every op: the readable path
    the fast one is tested against."""
    xs = x.to(stat_dtype(x))
    mean_in = xs.mean((2, 3))
    # two passes rather than var_mean, which warns of 0 degrees of freedom on an empty batch
    var_in = (xs - mean_in[:, :, None, None]).square().mean((2, 3))
    scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
    return ((xs - mean_in[:, :, None, None]) * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype)


def _affine_in_stat_dtype(affine: AffineFromMoments, mean_in: Tensor, var_in: Tensor) -> tuple[Tensor, Tensor]:
    # statistics stay in float32 (or float64) even under autocast, whose matmuls would run in fp16/bf16
    with torch.autocast(mean_in.device.type, enabled=False):
        scale, shift = affine(mean_in, var_in)
    return scale.expand_as(mean_in), shift.expand_as(mean_in)


class _NormalizeByMoments(torch.autograd.Function):
    """The training path of ``normalize_by_moments``.

    Autograd through the separate steps would write three full-size gradients of x (through the
    output, the mean and the variance) and add them up. Here the backward reads grad_y and x once for
    the (N, C) sums D = sum(grad_y * (x - mu_in)) and S = sum(grad_y), differentiates the small (N, C)
    graph of ``affine`` with them (plus the centring's own -scale * S towards mu_in), and writes grad_x
    once, from the closed form

        grad_x = grad_y * scale + (x - mu_in) * p + q,   p = 2 g_var / HW,   q = g_mean / HW

    (g_mean, g_var: gradients of the loss with respect to the IN statistics; the paper's appendix), with
    mu_in the exact mean, the rounded one plus its residual (``map_passes``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, affine: AffineFromMoments, *parameters: Tensor):
        over = passes_for(x)
        mean_in, var_in, residual = over.moments(x, True)
        with torch.enable_grad():
            mean_in.requires_grad_(ctx.needs_input_grad[0])
            var_in.requires_grad_(ctx.needs_input_grad[0])
            scale, shift = _affine_in_stat_dtype(affine, mean_in, var_in)
        ctx.save_for_backward(x, residual, *parameters)
        ctx.affine, ctx.passes = affine, over
        ctx.graph = (mean_in, var_in, scale, shift)
        return over.scale_shift(x, over.block_of(scale.detach(), shift.detach()), over.block_of(mean_in.detach()))

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, residual, *parameters = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable gradients, from the plain computation
            replay = functools.partial(reference_normalize_by_moments, affine=ctx.affine)
            grad_x, grad_parameters = replayed_gradients(
                replay, x, parameters, grad_y, ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
            )
            return (grad_x, None, *grad_parameters)
        mean_in, var_in, scale, shift = ctx.graph
        center, over = mean_in.detach(), ctx.passes
        dot, total = over.centered_dot_and_sum(grad_y, x, over.block_of(center))
        inputs = [t for t in (mean_in, var_in, *parameters) if t.requires_grad]
        # the small graph is kept (it is tiny) so that a backward with retain_graph=True can run again
        grads = iter(torch.autograd.grad((scale, shift), inputs, (dot, total), retain_graph=True, allow_unused=True))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_mean, grad_var = next(grads), next(grads)
            grad_mean = (torch.zeros_like(center) if grad_mean is None else grad_mean) - scale.detach() * total
            grad_var = torch.zeros_like(center) if grad_var is None else grad_var
            count = max(x.shape[2] * x.shape[3], 1)
            p, q = 2 * grad_var / count, grad_mean / count
            moments = over.block_of(center, center, residual)  # the grad_input pass reads rows 0 and 2
            grad_x = over.grad_input(grad_y, x, over.block_of(scale.detach()), over.block_of(p, q), moments, True)
        grad_parameters = [next(grads) if p.requires_grad else None for p in parameters]
        return (grad_x, None, *grad_parameters)
