"""PONO with its channel affine (``positional``) as Triton kernels: one launch forward, two backward.

Per pixel (n, h, w), over its C channel values x_c, with the layer's weight w_c and bias b_c:

    mu = mean_c x_c,   var = mean_c (x_c - mu)^2 (biased),   r = (var + eps)^(-1/2),   xhat_c = (x_c - mu) r
    forward    y_c = w_c xhat_c + b_c
    backward   g_c = grad_y_c w_c,
               grad_x_c = r (g_c - mean_c g - xhat_c mean_c(g xhat)),
               grad w_c = sum_{n,h,w} grad_y_c xhat_c,   grad b_c = sum_{n,h,w} grad_y_c

The input gradient is LayerNorm's over the channels of one pixel: with d mu / d x_c = 1 / C and
d var / d x_c = 2 (x_c - mu) / C, d r / d var = -r^3 / 2, the derivative of sum_j g_j (x_j - mu) r is
r (g_c - mean g) + sum_j g_j (x_j - mu) (-r^3 / 2) 2 (x_c - mu) / C = r (g_c - mean g) - r xhat_c mean(g xhat).

Programs. Each program owns a block of BLOCK_P pixels and loops over the channels in tiles of BLOCK_C
(so any C works; the per-pixel state is a few [BLOCK_P] vectors). The tile's long axis follows memory's
contiguous one: in NCHW (H*W > 1) a program's pixels belong to one sample and are contiguous,
BLOCK_P = min(next_pow2(H*W), 128) with as many channels as fill 2048 elements; in channels_last, and
for 1x1 maps whatever the strides (both layouts then address memory alike), the pixels of all samples are
numbered together, BLOCK_C = min(next_pow2(C), 32) contiguous channels by up to 2048 / BLOCK_C pixels, so
a batch of 1x1 maps fills whole tiles.

- forward, one launch: the statistics pass over the channels, then the output pass (x is read twice, a
  program's C * BLOCK_P values each time). When a gradient is needed it also stores the per-pixel
  (k, m, r) that the backward needs (below; 3 float32 per pixel, a C-th of x's size).
- backward, launch 1, the same programs: one pass over the channels sums g and g xhat per pixel and
  writes the program's partial sums of grad_y xhat and grad_y per channel to a (programs, 2, C) float32
  buffer; a second pass writes grad_x (skipped when x needs no gradient).
- backward, launch 2, one program per block of channels: sums the partials over the programs in a fixed
  order, and stores grad w, grad b in the parameters' dtype (fp16 for a layer converted with .half()).
  No atomics: the gradients are deterministic. It is not launched when neither parameter needs one.

Accuracy. The statistics are computed on d = x - k, k the pixel's value at channel 0: d is exact in
float32 whenever |mu| >> spread (Sterbenz), and of the size of the spread. Each channel tile's own mean and
sum of squared deviations (a two-pass computation in registers) are merged into the running ones with
Chan's pairwise formula (delta = mean_t - mean, mean += delta n_t / n, M2 += M2_t + delta^2 n_old n_t / n),
so the variance keeps float32 accuracy whatever the ratio of mean to spread, in one read. The mean is kept
as the pair (k, m = mean(d)) and never rounded to one float32 near mu: xhat = ((x - k) - m) r, where
x - k is exact, as in the tensor path (``positional.pono``). So a channel mean of 1e4 times the spread
costs no digits.

Types. x (and grad_y) float32, float16 or bfloat16, read directly; all arithmetic float32; full-size
outputs rounded once to x's dtype. weight and bias float32, float16 or bfloat16 (read as float32). Any
other case, float64 included, takes the layer's tensor path (``supports``). Under create_graph the
backward replays the tensor path (``fused.replayed_gradients``) for a differentiable result.

Nothing reads a value on the host: a training step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import _layout, _output_like, cdiv, kernel_path, launch, next_pow2, tl, triton

_TILE = 2048  # elements of one [BLOCK_C, BLOCK_P] tile: 16 per thread at 4 warps
_MAX_BLOCK_P = 128  # NCHW: contiguous pixels per program
_CHANNELS_LAST_BLOCK_C = 32  # channels_last: contiguous channels per tile
_REDUCE_BLOCK_C = 32
_REDUCE_BLOCK_R = 64
_NUM_WARPS = 4
_PARAMETER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

if triton is not None:

    @triton.jit
    def _pixels(C, HW, P, hw_blocks, CHANNELS_LAST: tl.constexpr, BLOCK_P: tl.constexpr):
        # This program's pixels: their index n * HW + hw among all P = N * HW pixels, their mask, the int64
        # offset of their channel 0 and the stride between channels.
        pid = tl.program_id(0)
        if CHANNELS_LAST:  # all samples' pixels numbered together: pixel q's channels start at q * C
            pixel = pid * BLOCK_P + tl.arange(0, BLOCK_P)
            base = pixel.to(tl.int64) * C
            return pixel, pixel < P, base, 1
        else:  # one sample's contiguous pixels
            n = pid // hw_blocks
            hw = (pid % hw_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
            base = n.to(tl.int64) * C * HW + hw
            return n * HW + hw, hw < HW, base, HW

    @triton.jit
    def _forward_kernel(
        x_ptr,
        y_ptr,
        stats_ptr,
        weight_ptr,
        bias_ptr,
        C,
        HW,
        P,
        hw_blocks,
        eps,
        SAVE: tl.constexpr,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        pixel, p_mask, base, c_stride = _pixels(C, HW, P, hw_blocks, CHANNELS_LAST, BLOCK_P)
        # the shift k: each pixel's channel 0 (module docstring, "Accuracy")
        k = tl.load(x_ptr + base, mask=p_mask, other=0.0).to(tl.float32)
        mean = tl.zeros([BLOCK_P], dtype=tl.float32)  # of d = x - k over the channels so far
        m2 = tl.zeros([BLOCK_P], dtype=tl.float32)  # their sum of squared deviations from it
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            mask = (c < C)[:, None] & p_mask[None, :]
            x = tl.load(x_ptr + base[None, :] + (c * c_stride)[:, None], mask=mask, other=0.0).to(tl.float32)
            before = c0 * 1.0
            tile_count = tl.minimum(C - c0, BLOCK_C) * 1.0
            total = before + tile_count
            d = tl.where(mask, x - k[None, :], 0.0)
            tile_mean = tl.sum(d, 0) / tile_count
            e = tl.where(mask, d - tile_mean[None, :], 0.0)
            delta = tile_mean - mean
            mean += delta * (tile_count / total)
            m2 += tl.sum(e * e, 0) + delta * delta * (before * tile_count / total)
        r = 1.0 / tl.sqrt(m2 / C + eps)
        if SAVE:
            tl.store(stats_ptr + pixel, k, mask=p_mask)
            tl.store(stats_ptr + P + pixel, mean, mask=p_mask)
            tl.store(stats_ptr + 2 * P + pixel, r, mask=p_mask)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_mask = c < C
            mask = c_mask[:, None] & p_mask[None, :]
            offsets = base[None, :] + (c * c_stride)[:, None]
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
            b = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
            xhat = ((x - k[None, :]) - mean[None, :]) * r[None, :]
            y = w[:, None] * xhat + b[:, None]
            tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(
        gy_ptr,
        x_ptr,
        gx_ptr,
        stats_ptr,
        weight_ptr,
        partial_ptr,
        C,
        HW,
        P,
        hw_blocks,
        NEEDS_X: tl.constexpr,
        CHANNELS_LAST: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        pixel, p_mask, base, c_stride = _pixels(C, HW, P, hw_blocks, CHANNELS_LAST, BLOCK_P)
        k = tl.load(stats_ptr + pixel, mask=p_mask, other=0.0)
        mean = tl.load(stats_ptr + P + pixel, mask=p_mask, other=0.0)
        r = tl.load(stats_ptr + 2 * P + pixel, mask=p_mask, other=0.0)
        # this program's row of the (programs, 2, C) partial sums of the parameters' gradients
        partial_ptr += tl.program_id(0).to(tl.int64) * 2 * C
        sum_g = tl.zeros([BLOCK_P], dtype=tl.float32)
        sum_g_xhat = tl.zeros([BLOCK_P], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_mask = c < C
            mask = c_mask[:, None] & p_mask[None, :]
            offsets = base[None, :] + (c * c_stride)[:, None]
            # masked lanes: grad_y = 0 and w = 0, so they add nothing to any sum
            gy = tl.load(gy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
            xhat = ((x - k[None, :]) - mean[None, :]) * r[None, :]
            g = gy * w[:, None]
            sum_g += tl.sum(g, 0)
            sum_g_xhat += tl.sum(g * xhat, 0)
            tl.store(partial_ptr + c, tl.sum(gy * xhat, 1), mask=c_mask)
            tl.store(partial_ptr + C + c, tl.sum(gy, 1), mask=c_mask)
        if NEEDS_X:
            mean_g = sum_g / C
            mean_g_xhat = sum_g_xhat / C
            for c0 in range(0, C, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                c_mask = c < C
                mask = c_mask[:, None] & p_mask[None, :]
                offsets = base[None, :] + (c * c_stride)[:, None]
                gy = tl.load(gy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
                xhat = ((x - k[None, :]) - mean[None, :]) * r[None, :]
                gx = r[None, :] * (gy * w[:, None] - mean_g[None, :] - xhat * mean_g_xhat[None, :])
                tl.store(gx_ptr + offsets, gx.to(gx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _parameter_gradients_kernel(
        partial_ptr,
        grad_weight_ptr,
        grad_bias_ptr,
        R,
        C,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # grad w, grad b of BLOCK_C channels: the sums over the R rows of the partials, in a fixed order
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < C
        weight_sum = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        bias_sum = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < R)[:, None] & c_mask[None, :]
            offsets = rows.to(tl.int64)[:, None] * 2 * C + c[None, :]
            weight_sum += tl.load(partial_ptr + offsets, mask=mask, other=0.0)
            bias_sum += tl.load(partial_ptr + C + offsets, mask=mask, other=0.0)
        grad_weight = tl.sum(weight_sum, 0)
        grad_bias = tl.sum(bias_sum, 0)
        tl.store(grad_weight_ptr + c, grad_weight.to(grad_weight_ptr.dtype.element_ty), mask=c_mask)
        tl.store(grad_bias_ptr + c, grad_bias.to(grad_bias_ptr.dtype.element_ty), mask=c_mask)


def supports(x: Tensor, weight: Tensor, bias: Tensor) -> bool:
    """Whether the kernels take this call: x on the kernel path (``kernels.kernel_path``) and not empty,
    one sample and the pixels of the batch each indexable in int32, parameters of a kernel dtype on x's
    device."""
    if not (kernel_path(x) and x.numel() > 0):
        return False
    n, c, h, w = x.shape
    return (
        c * h * w < 2**31
        and n * h * w < 2**31
        and all(p.dtype in _PARAMETER_DTYPES and p.device == x.device and p.is_contiguous() for p in (weight, bias))
    )


class PositionalKernels:
    """The kernels for inputs of one signature (``supports``; ``fused.FusedPlan``): tile shape and grid of their
    programs (module docstring, "Programs"), worked out once; a plan of the layer's calls
    (``base.NormBase.call_plan``) that holds no tensor."""

    def __init__(self, x: Tensor):
        channels_last = _layout(x, "x")
        n, c, h, w = x.shape
        self.c, self.hw, self.pixels = c, h * w, n * h * w
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # a 1x1 map addresses memory alike in both layouts: the channels are contiguous
        channels_last = channels_last or self.hw == 1
        if channels_last:
            block_c = min(next_pow2(c), _CHANNELS_LAST_BLOCK_C)
            block_p = min(next_pow2(self.pixels), _TILE // block_c)
            self.hw_blocks = 1  # unused
            self.programs = cdiv(self.pixels, block_p)
        else:
            block_p = min(next_pow2(self.hw), _MAX_BLOCK_P)
            block_c = min(next_pow2(c), _TILE // block_p)
            self.hw_blocks = cdiv(self.hw, block_p)
            self.programs = n * self.hw_blocks
        meta = {"CHANNELS_LAST": channels_last, "BLOCK_C": block_c, "BLOCK_P": block_p, "num_warps": _NUM_WARPS}
        # each launch's constants by its flag, made once (``launch`` takes them as they are); no FMA
        # contraction in the backward (``backward``)
        self.forward_meta = {save: dict(meta, SAVE=save) for save in (False, True)}
        self.backward_meta = {needs_x: dict(meta, NEEDS_X=needs_x, enable_fp_fusion=False) for needs_x in (False, True)}
        self.stats_shape = (3, self.pixels)
        self.partial_shape = (self.programs, 2, c)
        reduce_block_c = min(next_pow2(c), _REDUCE_BLOCK_C)
        self.reduce_grid = (cdiv(c, reduce_block_c),)
        self.reduce_meta = {"BLOCK_R": _REDUCE_BLOCK_R, "BLOCK_C": reduce_block_c, "num_warps": _NUM_WARPS}

    def forward(self, layer, x: Tensor, parameters, save: bool):
        """(y, stats): y in x's dtype and layout; stats the float32 (3, N * H * W) per-pixel (k, m, r) of the
        module docstring when ``save``, else None. One launch."""
        weight, bias = parameters
        y = _output_like(x)
        stats = x.new_empty(self.stats_shape, dtype=torch.float32) if save else None
        launch(
            _forward_kernel,
            (self.programs,),
            (x, y, stats if save else y, weight, bias, self.c, self.hw, self.pixels, self.hw_blocks, float(layer.eps)),
            self.forward_meta[save],
        )
        return y, stats

    def backward(self, layer, grad_y: Tensor, x: Tensor, parameters, stats: Tensor, needs_x: bool, needs_parameters):
        """(grad_x, [grad_weight, grad_bias]), grad_x None without ``needs_x`` and the parameters' gradients
        without ``needs_parameters``. Two launches (one when the parameters need no gradient)."""
        weight, bias = parameters
        grad_y = grad_y.contiguous(memory_format=self.memory_format)
        grad_x = _output_like(x) if needs_x else None
        partial = stats.new_empty(self.partial_shape)
        # No FMA contraction: g - mean_c g must cancel exactly where a pixel's g are all equal (one channel,
        # whose grad_x is 0), and a contracted gy * w - mean_c g leaves the product's rounding error, which r =
        # eps^(-1/2) then magnifies
        launch(
            _backward_kernel,
            (self.programs,),
            (
                grad_y,
                x,
                grad_x if needs_x else grad_y,
                stats,
                weight,
                partial,
                self.c,
                self.hw,
                self.pixels,
                self.hw_blocks,
            ),
            self.backward_meta[needs_x],
        )
        if not (needs_parameters[0] or needs_parameters[1]):
            return grad_x, [None, None]
        grad_weight, grad_bias = torch.empty_like(weight), torch.empty_like(bias)
        launch(
            _parameter_gradients_kernel,
            self.reduce_grid,
            (partial, grad_weight, grad_bias, self.programs, self.c),
            self.reduce_meta,
        )
        return grad_x, [grad_weight, grad_bias]
