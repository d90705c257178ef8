"""The Triton passes of sn_detection.layers.map_passes (``TritonPasses``) against float64 PyTorch references.

Runs on a CUDA GPU, or on the CPU under Triton's interpreter in the kernel-test environment:

    TRITON_INTERPRET=1 $(tools/setup_kernel_env.sh) -m pytest tests/kernels -q

Elsewhere the whole module is skipped (tests/kernels/conftest.py): without Triton, on the CPU without
TRITON_INTERPRET=1 (the reference stack's `pytest tests`), and under the interpreter of Triton < 3 (the
reference stack's Triton 2.3.1, whose interpreter fails on a plain row reduction). Shapes are small: the
interpreter runs every program in Python.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sn_detection.layers import kernels
from sn_detection.layers.kernels import TritonPasses

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = [torch.contiguous_format, torch.channels_last]
# odd sizes; 1x1 maps; an empty batch; channel counts that leave a channel block partly masked (C=7, 40);
# maps larger than one tile, so the reductions loop over H*W (17x19 in channels_last, 48x50 in NCHW)
SHAPES = [(2, 7, 3, 5), (3, 5, 1, 1), (0, 3, 4, 4), (2, 40, 17, 19), (1, 2, 48, 50)]


def _ids(values):
    return [str(v).replace("torch.", "") for v in values]


def _input(shape, dtype, layout, offset=0.5, spread=2.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * spread + offset
    return x.to(dtype).to(DEVICE).contiguous(memory_format=layout)


def _map_vector(shape, seed, offset=0.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape[:2], generator=generator) + offset).to(DEVICE)


def _per_map(v):
    return v.double()[:, :, None, None]


def _assert_like(out, x):
    """out has x's shape, dtype, device and memory layout (its very strides)."""
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert out.stride() == x.stride()


def _assert_vector(v, x):
    assert v.dtype == torch.float32 and v.shape == x.shape[:2] and v.device == x.device


def _moments(x):
    mean, var = TritonPasses(x).moments(x)
    return mean, var


def _assert_rounded_close(out, reference):
    """out, computed in float32 and rounded once to its dtype, is the float64 reference within about one
    unit in the last place of that dtype."""
    torch.testing.assert_close(out, reference.to(out.dtype), rtol=2 * torch.finfo(out.dtype).eps, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_moments(shape, dtype, layout):
    x = _input(shape, dtype, layout)
    mean, var = _moments(x)
    _assert_vector(mean, x)
    _assert_vector(var, x)
    ref_mean = x.double().mean((2, 3)) if x.numel() else x.new_zeros(shape[:2], dtype=torch.float64)
    ref_var = (x.double() - ref_mean[:, :, None, None]).square().mean((2, 3)) if x.numel() else ref_mean
    # the inputs are exact in float64: whatever their dtype, the moments are float32-accurate
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(var.double(), ref_var, rtol=1e-5, atol=1e-6)
    if shape[2] * shape[3] == 1:
        assert (var == 0).all()  # a 1x1 map's biased variance: no NaN


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_scale_shift(shape, dtype, layout):
    x = _input(shape, dtype, layout)
    scale, shift, center = _map_vector(shape, 1), _map_vector(shape, 2), _map_vector(shape, 3)
    over = TritonPasses(x)
    y = over.scale_shift(x, over.block_of(scale, shift), over.block_of(center))
    _assert_like(y, x)
    _assert_rounded_close(y, (x.double() - _per_map(center)) * _per_map(scale) + _per_map(shift))


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_centered_dot_and_sum(shape, dtype, layout):
    x = _input(shape, dtype, layout)
    grad_y = _input(shape, dtype, layout, offset=0.1, spread=1.0, seed=1)
    center = _map_vector(shape, 2, offset=0.5)
    over = TritonPasses(x)
    dot, total = over.centered_dot_and_sum(grad_y, x, over.block_of(center))
    _assert_vector(dot, x)
    _assert_vector(total, x)
    gy = grad_y.double()
    ref_dot = (gy * (x.double() - _per_map(center))).sum((2, 3))
    ref_total = gy.sum((2, 3))
    # sums of H*W terms of size ~1 that partly cancel: an absolute tolerance on the scale of the terms
    atol = 1e-5 * max(shape[2] * shape[3], 1) ** 0.5
    torch.testing.assert_close(dot.double(), ref_dot, rtol=1e-5, atol=atol)
    torch.testing.assert_close(total.double(), ref_total, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_grad_input(shape, dtype, layout):
    x = _input(shape, dtype, layout)
    grad_y = _input(shape, dtype, layout, offset=0.1, spread=1.0, seed=1)
    scale, p, q, center = (_map_vector(shape, seed) for seed in (2, 3, 4, 5))
    over = TritonPasses(x)
    grad_x = over.grad_input(grad_y, x, over.block_of(scale), over.block_of(p, q), over.block_of(center), False)
    _assert_like(grad_x, x)
    reference = grad_y.double() * _per_map(scale) + (x.double() - _per_map(center)) * _per_map(p) + _per_map(q)
    _assert_rounded_close(grad_x, reference)


def _batch_norm_moments(x):
    """torch.nn.BatchNorm2d's float32 batch statistics of each (n, c) map (as channels of a 1-sample
    batch): the accuracy to match. NCHW input: torch's CPU kernel for channels_last is less accurate."""
    n, c, h, w = x.shape
    bn = torch.nn.BatchNorm2d(n * c, momentum=1.0).to(x.device)  # momentum 1: running stats = batch stats
    bn.train()
    with torch.no_grad():
        bn(x.contiguous().reshape(1, n * c, h, w))
    unbiased_to_biased = (h * w - 1) / (h * w)
    return bn.running_mean.view(n, c).double(), bn.running_var.view(n, c).double() * unbiased_to_biased


# maps within one tile (centred at their own mean), and maps of several tiles in both layouts
@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 5, 48, 50)], ids=_ids([(2, 3, 16, 16), (1, 5, 48, 50)]))
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
def test_moments_accuracy_mean_far_from_zero(layout, shape):
    """Maps whose mean is 1e4 times their spread: E[x^2] - E[x]^2 in float32 keeps no digit of the
    variance; the shifted sums are about as accurate as BatchNorm's float32 statistics."""
    generator = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(shape, generator=generator)
    x[:, :, :4] += 3.0  # first rows 3 spreads off: the first tile, hence the shift, is off-centre
    x = x.to(DEVICE).contiguous(memory_format=layout)
    ref_var, ref_mean = torch.var_mean(x.double(), dim=(2, 3), correction=0)

    naive_var = (x * x).mean((2, 3)) - x.mean((2, 3)).square()
    assert ((naive_var.double() - ref_var).abs() / ref_var).max() > 0.1  # the cancellation is real here

    mean, var = _moments(x)
    bn_mean, bn_var = _batch_norm_moments(x)
    var_error = ((var.double() - ref_var).abs() / ref_var).max().item()
    bn_var_error = ((bn_var - ref_var).abs() / ref_var).max().item()
    # a few float32 rounding units (BatchNorm: ~1e-7 to 3e-7 here)
    assert var_error < 1e-6 and var_error <= 10 * bn_var_error
    # the mean: within half a unit in the last place of 1e4 in float32 (~5e-4), like BatchNorm's
    ulp = torch.finfo(torch.float32).eps * 2**13
    mean_error = (mean.double() - ref_mean).abs().max().item()
    bn_mean_error = (bn_mean - ref_mean).abs().max().item()
    assert mean_error <= max(bn_mean_error, ulp / 2) * 1.01


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
def test_the_residual_holds_what_rounding_took_off_the_mean(layout):
    """mean + residual is the exact mean to float32 accuracy of the spread, where the float32 mean alone is
    up to half a unit of 1e4 off; grad_input with it is the variance's derivative at the exact mean."""
    generator = torch.Generator().manual_seed(3)
    x = 1e4 + torch.randn(2, 3, 40, 60, generator=generator)  # two tiles per map: a shift off the mean
    x = x.to(DEVICE).contiguous(memory_format=layout)
    exact = x.double().mean((2, 3))
    over = TritonPasses(x)
    moments = over.moments(x, True)
    mean, var, residual = moments
    plain_mean, plain_var = _moments(x)
    assert torch.equal(mean, plain_mean) and torch.equal(var, plain_var)
    rounding = (mean.double() - exact).abs().max().item()
    assert rounding > 1e-5
    assert (mean.double() + residual.double() - exact).abs().max().item() < 1e-6

    grad_var = torch.randn(2, 3, generator=generator).to(DEVICE)
    p, zeros = 2 * grad_var / (40 * 60), torch.zeros(2, 3, device=DEVICE)
    xd = x.double()
    exact_grad = (xd - exact[:, :, None, None]) * p.double()[:, :, None, None]
    grad_y = torch.zeros_like(x)
    pq = torch.stack([p, zeros])
    with_residual = over.grad_input(grad_y, x, zeros, pq, moments, residual=True)
    without = over.grad_input(grad_y, x, zeros, pq, moments, residual=False)
    error, error_without = ((g.double() - exact_grad).abs().max().item() for g in (with_residual, without))
    assert error < error_without / 10 and error < 1e-6 * exact_grad.abs().max().item(), (error, error_without)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
def test_centered_dot_accuracy_mean_far_from_zero(layout):
    """x - center is exact for maps far from zero centred at their mean: the dot keeps float32 accuracy."""
    generator = torch.Generator().manual_seed(1)
    x = (1e4 + torch.randn(2, 3, 16, 16, generator=generator)).to(DEVICE).contiguous(memory_format=layout)
    grad_y = torch.randn(2, 3, 16, 16, generator=generator).to(DEVICE).contiguous(memory_format=layout)
    center = x.double().mean((2, 3)).float()
    over = TritonPasses(x)
    dot, _ = over.centered_dot_and_sum(grad_y, x, over.block_of(center))
    ref_dot = (grad_y.double() * (x.double() - center.double()[:, :, None, None])).sum((2, 3))
    scale = (
        grad_y.double().square().sum((2, 3)) * (x.double() - center.double()[:, :, None, None]).square().sum((2, 3))
    ).sqrt()
    assert ((dot.double() - ref_dot).abs() / scale).max() < 1e-6


def test_empty_maps():
    x = torch.zeros(2, 3, 0, 4, device=DEVICE)
    over = TritonPasses(x)
    mean, var = over.moments(x)
    assert mean.shape == var.shape == (2, 3) and (mean == 0).all() and (var == 0).all()
    ones = torch.ones(2, 3, device=DEVICE)
    assert over.scale_shift(x, over.block_of(ones, ones), ones).shape == x.shape
    assert over.grad_input(x, x, ones, over.block_of(ones, ones), ones, False).shape == x.shape
    dot, total = over.centered_dot_and_sum(x, x, ones)
    assert (dot == 0).all() and (total == 0).all()


def test_unsupported_inputs_raise_value_error():
    shape = (2, 3, 4, 5)
    x = _input(shape, torch.float32, torch.contiguous_format)
    ones = torch.ones(2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        TritonPasses(x.double())
    with pytest.raises(ValueError, match="strides"):
        TritonPasses(x[:, :, :, ::2])
    with pytest.raises(ValueError, match="strides"):
        TritonPasses(x.transpose(2, 3))
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        TritonPasses(x[0])
    over = TritonPasses(x)
    with pytest.raises(ValueError, match="float32"):
        over.block_of(ones.double(), ones)
    with pytest.raises(ValueError, match=r"\(N, C\)"):
        over.block_of(ones[:, :2], ones)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
def test_grad_y_is_taken_in_x_layout(layout):
    """Autograd may hand over grad_y in another layout than x's: the passes read it in x's."""
    x = _input((2, 3, 4, 5), torch.float32, layout)
    grad_y = _input((2, 3, 4, 5), torch.float32, layout, seed=1)
    other = grad_y.contiguous(
        memory_format=torch.channels_last if layout == torch.contiguous_format else torch.contiguous_format
    )
    over, ones = TritonPasses(x), torch.ones(2, 3, device=DEVICE)
    pq, moments = over.block_of(ones, ones), over.block_of(ones)
    grad_x = over.grad_input(grad_y, x, ones, pq, moments, False)
    assert torch.equal(over.grad_input(other, x, ones, pq, moments, False), grad_x)
    assert torch.equal(over.centered_dot_and_sum(other, x, moments), over.centered_dot_and_sum(grad_y, x, moments))


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors run only under the interpreter")
def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    monkeypatch.setattr(kernels, "_INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        TritonPasses(torch.zeros(1, 1, 2, 2))


def test_available():
    assert kernels.available()


# Compiled by Triton for an H100 (sm_90), without a GPU and without the interpreter, in a subprocess: the
# interpreter runs the kernels as Python and misses what only the compiler checks (types of loop-carried
# values, constexpr specializations of arguments equal to 1). Every dtype, both layouts, the tile shapes
# TritonPasses chooses.
_COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sn_detection.layers import kernels as K

    kernels = [K._moments_kernel, K._centered_dot_and_sum_kernel, K._scale_shift_kernel, K._grad_input_kernel]
    full_size = {"x_ptr", "y_ptr", "gy_ptr", "gx_ptr"}
    count = 0
    for dtype in ("fp32", "fp16", "bf16"):
        for channels_last, c, hw in ((False, 64, 3000), (False, 7, 15), (True, 40, 323)):
            block_c, block_hw = K._tile_shape(c, hw, channels_last)
            for kernel in kernels:
                for ones in ((), ("C", "HW")):  # Triton specializes integer arguments equal to 1
                    constants = dict(CHANNELS_LAST=channels_last, BLOCK_C=block_c, BLOCK_HW=block_hw)
                    constants.update((name, 1) for name in ones)
                    signature = {
                        name: "constexpr" if name in constants
                        else (f"*{dtype}" if name in full_size else "*fp32") if name.endswith("_ptr")
                        else "i32"
                        for name in kernel.arg_names
                    }
                    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
                    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
                    assert compiled.asm["cubin"]
                    count += 1
    print("compiled", count)
""")


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the other tests compile and run the kernels")
def test_kernels_compile_for_h100():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0 and "No module named 'triton.backends" in result.stderr:
        pytest.skip("this Triton has no CUDA compiler backend")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled" in result.stdout
