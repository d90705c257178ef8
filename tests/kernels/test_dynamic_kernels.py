"""DN's fused (N, C) kernels (sn_detection.layers.dynamic_kernels) against the autograd oracle: the output,
the gradients of x and of every parameter (the gates' straight-through ones included) and every buffer,
for gate patterns that pool contiguous and strided channel sets, with and without the batch, in training
and evaluation, for channel counts with and without an odd factor, and the launch count of a training step.

Runs where tests/kernels/test_map_passes.py runs (a CUDA GPU, or the CPU under Triton's interpreter in
the kernel-test environment); skipped elsewhere. Shapes are small: the interpreter runs every program in
Python.
"""

import copy
import functools
import os

import pytest
import torch

from sn_detection.benchmarks.launch_counts import count_training_step, recorded_kernels
from sn_detection.layers import DynamicNorm2d, dynamic_kernels
from sn_detection.layers.moment_normalizer import reference_normalize_by_moments

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
FP32 = 2e-5
# y and grad_x are rounded once to the input's dtype; the rest is float32 in both computations
ROUNDED = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
DN_KERNELS = ("_forward_kernel", "_levels_backward_kernel", "_batch_backward_kernel")


def make_layer(num_channels, pattern, batch_pool, seed=0):
    """A DN layer with random affine parameters, running statistics away from 0 and 1, and its channel
    gates all off, all on, or of random signs (strided, non-contiguous groupings)."""
    generator = torch.Generator().manual_seed(seed)
    layer = DynamicNorm2d(num_channels)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.3 * torch.randn(num_channels, generator=generator))
        layer.bias.copy_(0.3 * torch.randn(num_channels, generator=generator))
        levels = layer.channel_gates.numel()
        if pattern == "off":
            signs = -torch.ones(levels)
        elif pattern == "on":
            signs = torch.ones(levels)
        else:
            signs = torch.tensor([1.0, -1.0]).repeat(levels)[:levels]
            signs = signs[torch.randperm(levels, generator=generator)]
        layer.channel_gates.copy_(signs * (0.5 + torch.rand(levels, generator=generator)))
        layer.batch_gate.fill_(0.7 if batch_pool else -0.7)
        layer.running_mean.copy_(torch.randn(num_channels, generator=generator))
        layer.running_var.copy_(0.5 + torch.rand(num_channels, generator=generator))
    return layer.to(DEVICE)


def make_input(shape, seed=1, dtype=torch.float32, layout=torch.contiguous_format, offset=0.0, spread=1.0):
    generator = torch.Generator().manual_seed(seed)
    # per-channel offsets and scales, so that pooling over different channel sets changes the result
    channels = 1.5 * torch.randn(1, shape[1], 1, 1, generator=generator) + offset
    scales = (0.5 + torch.rand(1, shape[1], 1, 1, generator=generator)) * spread
    x = channels + scales * torch.randn(shape, generator=generator)
    grad_y = torch.randn(shape, generator=generator)
    convert = lambda t: t.to(DEVICE).to(dtype).contiguous(memory_format=layout)  # noqa: E731
    return convert(x), convert(grad_y)


def oracle(layer, x):
    affine = functools.partial(layer.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])
    return reference_normalize_by_moments(x, affine)


def run(layer, x, grad_y, forward=None):
    """Output, gradients (x and every parameter) and buffers after one forward and backward: through the
    layer, whose DN kernels must run, or through ``forward(layer, x)``."""
    x = x.detach().clone().requires_grad_()
    with recorded_kernels() as launched:
        y = layer(x) if forward is None else forward(layer, x)
        y.backward(grad_y)
    if forward is None:
        assert sorted(set(launched) & set(DN_KERNELS)) == sorted(DN_KERNELS), launched
    grads = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return {"y": y.detach(), **grads, **{name: b.clone() for name, b in layer.named_buffers()}}


def assert_matches(actual, expected, tolerance=FP32, rounded=None):
    """Every value within ``tolerance`` relative to its own magnitude (at least 1); y and grad_x within
    ``rounded`` where they are rounded to a half-precision dtype."""
    assert actual.keys() == expected.keys()
    for key, want in expected.items():
        got = actual[key]
        if want is None:  # a parameter nothing depends on (the empty channel gates of C = 1)
            assert got is None or got.numel() == 0, key
            continue
        assert got is not None and got.dtype == want.dtype and got.shape == want.shape, key
        tol = rounded if rounded is not None and key in ("y", "x") else tolerance
        atol = tol * max(1.0, want.double().abs().max().item()) if want.numel() else 0.0
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=atol, msg=lambda m: f"{key}: {m}")


def check_train_then_eval(layer, shape, seed=1, **input_options):
    """A training step on the kernels against the oracle, then an evaluation step (with the running
    statistics the training step left)."""
    for training in (True, False):
        x, grad_y = make_input(shape, seed=seed + training, **input_options)
        layer.train(training)
        fused = run(copy.deepcopy(layer), x, grad_y)
        assert_matches(fused, run(copy.deepcopy(layer), x, grad_y, oracle))
        with torch.no_grad():  # the next step starts from the buffers the step left
            for name, buffer in layer.named_buffers():
                buffer.copy_(fused[name])


@pytest.mark.parametrize("batch_pool", [False, True], ids=["own-sample", "batch-pool"])
@pytest.mark.parametrize("pattern", ["off", "on", "mixed"])
@pytest.mark.parametrize("num_channels", [16, 24, 7])
def test_gate_patterns(num_channels, pattern, batch_pool):
    layer = make_layer(num_channels, pattern, batch_pool, seed=num_channels)
    check_train_then_eval(layer, (3, num_channels, 2, 3))


@pytest.mark.parametrize("batch_pool", [False, True], ids=["own-sample", "batch-pool"])
def test_one_channel_has_no_channel_gate(batch_pool):
    check_train_then_eval(make_layer(1, "off", batch_pool), (2, 1, 3, 2))


def test_many_samples_span_several_tiles():
    # C = 96 = 2^5 * 3: 6 levels; 70 samples are several programs of the per-sample kernels and several
    # [BLOCK_N, BLOCK_C] tiles of every loop over the batch
    check_train_then_eval(make_layer(96, "mixed", batch_pool=True, seed=3), (70, 96, 1, 2))


@pytest.mark.parametrize("shape", [(1, 24, 1, 1), (2, 16, 1, 1), (1, 16, 2, 2)], ids=["1x1-one", "1x1-two", "one"])
@pytest.mark.parametrize("pattern", ["mixed", "on"])
def test_single_samples_and_one_pixel_maps(shape, pattern):
    # (1, C, 1, 1): one value per channel, the running variance stays as it is
    layer = make_layer(shape[1], pattern, batch_pool=True, seed=5)
    before = layer.running_var.clone()
    check_train_then_eval(layer, shape)
    if shape[0] * shape[2] * shape[3] == 1:
        torch.testing.assert_close(layer.running_var, before, rtol=0, atol=0)


def test_channel_groups_across_chunks(monkeypatch):
    # chunks of 8 channels: a group's members lie in other chunks, read back after the barrier
    monkeypatch.setattr(dynamic_kernels, "_MAX_CHUNK", 8)
    for pattern in ("mixed", "on"):
        check_train_then_eval(make_layer(24, pattern, batch_pool=True, seed=6), (2, 24, 2, 2))


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_input_dtypes_and_layouts(dtype, layout):
    layer = make_layer(24, "mixed", batch_pool=True, seed=7)
    for training in (True, False):
        x, grad_y = make_input((2, 24, 3, 2), seed=8, dtype=dtype, layout=layout)
        layer.train(training)
        fused = run(copy.deepcopy(layer), x, grad_y)
        assert fused["y"].dtype == dtype and fused["x"].dtype == dtype
        assert fused["x"].is_contiguous(memory_format=layout)
        assert_matches(fused, run(copy.deepcopy(layer), x, grad_y, oracle), tolerance=1e-4, rounded=ROUNDED.get(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_parameters_get_gradients_in_their_dtype(dtype):
    layer = make_layer(16, "mixed", batch_pool=True, seed=9).to(dtype).train()
    x, grad_y = make_input((2, 16, 2, 2), seed=10, dtype=dtype)
    fused = run(copy.deepcopy(layer), x, grad_y)
    for name, _ in layer.named_parameters():
        assert fused[name].dtype == dtype, name
    assert_matches(
        fused, run(copy.deepcopy(layer), x, grad_y, oracle), tolerance=ROUNDED[dtype], rounded=ROUNDED[dtype]
    )


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_large_channel_means_keep_fp32_accuracy(training):
    """Channel means 1e4 times the spread, against the float64 oracle: every value within fp32's rounding
    of the data (the IN means are float32 themselves: an error of eps * 1e4 in them moves what depends
    on differences of means) and no worse than the float32 autograd path's."""
    layer = make_layer(24, "mixed", batch_pool=True, seed=11)
    x, grad_y = make_input((3, 24, 3, 3), seed=12, offset=1e4)
    with torch.no_grad():
        layer.running_mean.copy_(x.double().mean((0, 2, 3)).float())
        layer.running_var.copy_(x.double().var((0, 2, 3), unbiased=False).float())
    layer.train(training)
    fused = run(copy.deepcopy(layer), x, grad_y)
    autograd = run(copy.deepcopy(layer), x, grad_y, oracle)
    exact = run(copy.deepcopy(layer).double(), x.double(), grad_y.double(), oracle)
    rounding = torch.finfo(torch.float32).eps * x.abs().max().item()  # of the data: 1.2e-3
    for key, want in exact.items():
        error = (fused[key].double() - want).abs().max().item()
        autograd_error = (autograd[key].double() - want).abs().max().item()
        magnitude = max(1.0, want.abs().max().item())
        assert error <= 4 * rounding * magnitude, (key, error)
        assert error <= max(2 * autograd_error, 8 * torch.finfo(torch.float32).eps * magnitude), (
            key,
            error,
            autograd_error,
        )


def test_a_training_step_is_seven_launches_without_syncs():
    layer = make_layer(96, "mixed", batch_pool=True, seed=13)
    x, grad_y = make_input((2, 96, 3, 3), seed=14)
    counts = count_training_step(layer, x, grad_y)
    assert counts.syncs == 0, counts.operations
    assert counts.launches <= 20, counts.operations
    assert all(counts.operations["triton:" + kernel] == 1 for kernel in DN_KERNELS), counts.operations
    assert counts.launches == 7, counts.operations  # the 4 full-size passes and DN's 3 kernels


def test_the_batch_average_keeps_the_autograd_path():
    layer = make_layer(16, "on", batch_pool=True)
    x, _ = make_input((2, 16, 2, 2))
    assert layer.call_plan(x) is not None
    layer.start_batch_average()
    assert layer.call_plan(x) is None
