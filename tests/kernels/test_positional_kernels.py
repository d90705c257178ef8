"""PONO on its Triton kernels (``positional_kernels``) against the layer's tensor path (``plain_forward``)
and a float64 computation: output and every gradient, fp32 / fp16 / bf16, NCHW and channels_last, shapes
that take different tilings (one image, 1x1 maps, one channel, C = 2048, several pixel blocks, more programs
than the parameter-gradient kernel sums in one step), channel means 1e4 times the spread, create_graph, a
layer converted with .half(); and what a training step launches.

Runs where tests/kernels/test_map_passes.py runs (a CUDA GPU, or the CPU under Triton's interpreter).
"""

import copy
import os

import pytest
import torch

from sn_detection.benchmarks.launch_counts import count_dispatch, count_training_step
from sn_detection.layers import build_norm

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
NCHW, CHANNELS_LAST = torch.contiguous_format, torch.channels_last
LAYOUTS = pytest.mark.parametrize("layout", [NCHW, CHANNELS_LAST], ids=["nchw", "channels_last"])
# one image; 1x1 maps; one channel; C = 24; several NCHW pixel blocks (H*W > 128); 70 programs (> the 64
# rows the parameter-gradient kernel sums per step); C = 2048 (64 to 128 channel tiles)
SHAPES = [(1, 16, 3, 5), (3, 24, 1, 1), (2, 1, 3, 4), (2, 24, 6, 7), (1, 8, 12, 13), (70, 16, 1, 2), (1, 2048, 1, 2)]


def make(channels, seed=0):
    torch.manual_seed(seed)
    layer = build_norm("PONO", channels)
    with torch.no_grad():
        layer.weight.add_(0.3 * torch.randn_like(layer.weight))
        layer.bias.add_(0.3 * torch.randn_like(layer.bias))
    return layer.to(DEVICE)


def inputs(shape, dtype=torch.float32, layout=NCHW, seed=1, mean=0.7, spread=1.5):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * spread + mean
    grad_y = torch.randn(shape, generator=generator)
    return (t.to(DEVICE, dtype).contiguous(memory_format=layout) for t in (x, grad_y))


def tensor_path(layer, x):
    return layer.plain_forward(x)


def run(layer, x, grad_y, forward=None):
    """(output, {x, weight, bias: gradient}) of one forward and backward of a copy of ``layer``."""
    layer = copy.deepcopy(layer)
    x = x.detach().clone().requires_grad_()
    y = layer(x) if forward is None else forward(layer, x)
    y.backward(grad_y)
    return y.detach(), {"x": x.grad, "weight": layer.weight.grad, "bias": layer.bias.grad}


def kernel_run(layer, x, grad_y):
    """``run`` on the kernels, checked to have taken them: one forward and two backward launches."""
    result = []
    operations = count_dispatch(lambda: result.append(run(layer, x, grad_y))).operations
    assert operations["triton:_forward_kernel"] == 1 and operations["triton:_backward_kernel"] == 1, operations
    assert operations["triton:_parameter_gradients_kernel"] == 1, operations
    return result[0]


def float64_run(layer, x, grad_y):
    return run(copy.deepcopy(layer).double(), x.double(), grad_y.double(), tensor_path)


def assert_close(actual, expected, tolerance):
    """Output and gradients within ``tolerance``, relative to the expected tensor's largest magnitude (the
    parameters' gradients are sums over N * H * W)."""
    pairs = [("output", actual[0], expected[0])] + [(key, actual[1][key], expected[1][key]) for key in expected[1]]
    for what, got, want in pairs:
        assert got is not None and got.shape == want.shape, what
        scale = max(want.double().abs().max().item(), 1.0)
        torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=tolerance * scale, msg=what)


@LAYOUTS
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_matches_the_tensor_path_and_float64(shape, layout):
    layer = make(shape[1])
    x, grad_y = inputs(shape, layout=layout)
    kernels = kernel_run(layer, x, grad_y)
    assert kernels[0].stride() == x.stride() and kernels[1]["x"].stride() == x.stride()
    assert kernels[1]["weight"].dtype == torch.float32
    assert_close(kernels, run(layer, x, grad_y, tensor_path), 1e-5)
    assert_close(kernels, float64_run(layer, x, grad_y), 1e-5)


@LAYOUTS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 24, 3, 5), (3, 40, 1, 1)], ids=["2x24x3x5", "3x40x1x1"])
def test_half_precision_is_the_float32_computation_rounded_once(shape, dtype, layout):
    layer = make(shape[1])
    x, grad_y = inputs(shape, dtype, layout)
    half = kernel_run(layer, x, grad_y)
    full = run(layer, x.float(), grad_y.float(), tensor_path)  # the same values, in float32
    assert half[0].dtype == dtype and half[1]["x"].dtype == dtype
    assert half[0].is_contiguous(memory_format=layout) and half[1]["x"].is_contiguous(memory_format=layout)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(half[0].float(), full[0], rtol=eps, atol=eps)
    torch.testing.assert_close(half[1]["x"].float(), full[1]["x"], rtol=eps, atol=eps * full[1]["x"].abs().max().item())
    for key in ("weight", "bias"):  # float32 sums of the same values
        torch.testing.assert_close(half[1][key], full[1][key], rtol=1e-5, atol=1e-5 * full[1][key].abs().max().item())
    # and the tensor path on the half input agrees as closely
    plain = run(layer, x, grad_y, tensor_path)
    torch.testing.assert_close(half[0], plain[0], rtol=eps, atol=eps)


@LAYOUTS
@pytest.mark.parametrize("shape", [(3, 16, 5, 6), (2, 200, 2, 1)], ids=["3x16x5x6", "2x200x2x1"])
def test_large_channel_means_keep_float32_accuracy(shape, layout):
    # mean 1e4, spread 1: the kernels must be as close to float64 as the tensor path (within a factor 2),
    # whose float32 mean is itself a rounded number near 1e4
    layer = make(shape[1])
    x, grad_y = inputs(shape, layout=layout, mean=1e4, spread=1.0)
    exact = float64_run(layer, x, grad_y)
    results = {"kernels": kernel_run(layer, x, grad_y), "plain": run(layer, x, grad_y, tensor_path)}
    errors = {
        name: {
            key: (got.double() - want.double()).abs().max().item()
            for key, got, want in [("output", r[0], exact[0])] + [(k, r[1][k], exact[1][k]) for k in exact[1]]
        }
        for name, r in results.items()
    }
    for key, error in errors["kernels"].items():
        size = max(exact[0].abs().max().item() if key == "output" else exact[1][key].abs().max().item(), 1.0)
        assert error <= 2 * errors["plain"][key] + 1e-6 * size, (key, errors)


def test_a_double_backward_replays_the_tensor_path():
    layer = make(8)
    x, _ = inputs((2, 8, 3, 4))

    def penalty(forward):
        module = copy.deepcopy(layer)
        inp = x.detach().clone().requires_grad_()
        y = module(inp) if forward is None else forward(module, inp)
        (grad_x,) = torch.autograd.grad(y.square().sum(), inp, create_graph=True)
        grad_x.square().sum().backward()
        return [inp.grad, module.weight.grad, module.bias.grad]

    launched = []
    operations = count_dispatch(lambda: launched.append(penalty(None))).operations
    assert operations["triton:_forward_kernel"] == 1, operations
    for got, want in zip(launched[0], penalty(tensor_path)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(want.abs().max().item(), 1.0))


def test_a_layer_converted_to_half_keeps_its_parameters_dtype_in_the_gradients():
    layer = make(16).half()
    for dtype in (torch.float16, torch.float32):
        x, grad_y = inputs((2, 16, 4, 6), dtype)
        kernels = kernel_run(layer, x, grad_y)
        expected = run(layer, x, grad_y, tensor_path)
        assert kernels[0].dtype == expected[0].dtype == dtype
        for key, grad in expected[1].items():
            assert kernels[1][key].dtype == grad.dtype, key
        assert_close(kernels, expected, 2e-3)


def test_evaluation_is_training_and_inference_is_one_launch():
    layer = make(24)
    x, _ = inputs((2, 24, 3, 5), layout=CHANNELS_LAST)
    trained = layer.train()(x.requires_grad_()).detach()
    x = x.detach()
    with torch.no_grad():
        counts = count_dispatch(lambda: layer.eval()(x))
        y = layer(x)
    assert counts.launches == 1 and counts.syncs == 0, counts.operations
    assert counts.operations["triton:_forward_kernel"] == 1, counts.operations
    assert torch.equal(y, trained)
    assert torch.equal(y, layer.train()(x).detach())  # no input or parameter needs a gradient: one launch too


def test_gradients_of_part_of_the_inputs_are_deterministic():
    layer = make(16)
    x, grad_y = inputs((2, 16, 3, 5))
    full = run(layer, x, grad_y, tensor_path)
    # x without a gradient: the parameters' gradients only
    frozen_x = copy.deepcopy(layer)
    frozen_x(x).backward(grad_y)
    torch.testing.assert_close(frozen_x.weight.grad, full[1]["weight"], rtol=1e-5, atol=1e-5)
    # frozen parameters: grad_x only, without the parameter-gradient kernel
    frozen = copy.deepcopy(layer).requires_grad_(False)
    inp = x.clone().requires_grad_()
    counts = count_dispatch(lambda: frozen(inp).backward(grad_y))
    assert counts.operations["triton:_parameter_gradients_kernel"] == 0 and counts.launches <= 2, counts.operations
    torch.testing.assert_close(inp.grad, full[1]["x"], rtol=1e-5, atol=1e-5)
    # the same gradients, bit for bit, run after run
    first, second = kernel_run(layer, x, grad_y), kernel_run(layer, x, grad_y)
    assert all(torch.equal(first[1][key], second[1][key]) for key in first[1])


def test_what_the_kernels_do_not_take_falls_back_to_the_tensor_path():
    layer = make(8)
    float64, empty = torch.randn(2, 8, 3, 4, dtype=torch.float64), torch.randn(0, 8, 3, 4)
    strided = torch.randn(2, 8, 3, 8, device=DEVICE)[..., ::2]  # strided on the device itself
    for x in (float64.to(DEVICE), empty.to(DEVICE), strided):
        counts = count_dispatch(lambda: layer(x))
        assert counts.operations["triton:_forward_kernel"] == 0, counts.operations
        torch.testing.assert_close(layer(x), tensor_path(layer, x))


@LAYOUTS
def test_a_training_step_launches_at_most_four_kernels_and_never_waits(layout):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 3, 5, generator=generator)
    grad_y = torch.randn(x.shape, generator=generator)
    x, grad_y = (t.to(DEVICE).contiguous(memory_format=layout) for t in (x, grad_y))
    counts = count_training_step(build_norm("PONO", 64).to(DEVICE), x, grad_y)
    assert counts.launches <= 4 and counts.syncs == 0, counts.operations
