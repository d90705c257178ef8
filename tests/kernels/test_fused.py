"""SN, SyncSN and BNSR on their fused kernels (``moment_normalizer``, ``switchable_kernels``, ``skewness_kernels``)
against the autograd path they replace: output, every gradient and every buffer, in training and evaluation, fp32 /
fp16 / bf16, NCHW and channels_last, shapes a detector produces (one image, 1x1 maps, more samples than one tile
holds), and where the fused path must step aside (batch average, create_graph).

Runs where tests/kernels/test_map_passes.py runs (a CUDA GPU, or the CPU under Triton's interpreter).
"""

import copy
import functools
import os

import pytest
import torch

from sn_detection.benchmarks.launch_counts import count_dispatch
from sn_detection.layers import build_norm, update_batch_average
from sn_detection.layers.moment_normalizer import reference_normalize_by_moments

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
FORWARD_KERNEL = dict.fromkeys(["SN", "SyncSN", "SSN", "SyncSSN", "BNSR"], "triton:_forward_kernel")
# (name, options): SN and SSN with and without their BN branch, BNSR at p = 1 (BatchNorm), above and below 1
LAYERS = [
    ("SN", {}),
    ("SN", {"use_bn": False}),
    ("SyncSN", {}),
    ("BNSR", {}),
    ("BNSR", {"p": 1.0}),
    ("BNSR", {"p": 1.3}),
    ("SSN", {}),
    ("SSN", {"use_bn": False}),
    ("SyncSSN", {}),
]
IDS = ["SN", "SN-no-bn", "SyncSN", "BNSR", "BNSR-p1", "BNSR-p1.3", "SSN", "SSN-no-bn", "SyncSSN"]
SSN_RADIUS = 0.3  # SparsestMax between the sparsemax and the circle for the perturbed logits (``make``)
SHAPES = [(3, 16, 5, 7), (70, 24, 1, 2), (1, 8, 1, 1), (2, 8, 1, 1)]  # 70: more samples than a tile


def make(name, options, channels, training, seed=0):
    torch.manual_seed(seed)
    layer = build_norm(name, channels, **options)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
        if hasattr(layer, "running_mean"):  # evaluation uses them: not the trivial 0 and 1
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
    if hasattr(layer, "set_radius"):
        layer.set_radius(SSN_RADIUS)
    return layer.to(DEVICE).train(training)


def autograd_path(layer, x):
    """The same layer through its tensor-operation path (the oracle)."""
    if hasattr(layer, "scale_and_shift"):
        affine = functools.partial(layer.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])
        return reference_normalize_by_moments(x, affine)
    return layer.plain_forward(x)


def run(layer, x, grad_y, forward=None):
    x = x.detach().clone().requires_grad_()
    y = layer(x) if forward is None else forward(layer, x)
    y.backward(grad_y)
    grads = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return y.detach(), grads, {name: b.clone() for name, b in layer.named_buffers()}


def assert_close(actual, expected, tolerance):
    """Each tensor within ``tolerance`` of the other, relative to the largest magnitude of the expected one
    (the logits' gradients are sums over every (n, c): their size grows with the batch)."""
    for got, want, what in [(actual[0], expected[0], "output")] + [
        (actual[i][key], want, key) for i in (1, 2) for key, want in expected[i].items()
    ]:
        assert got is not None and got.dtype == want.dtype, what
        scale = max(want.double().abs().max().item(), 1.0) if want.numel() else 1.0
        torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=tolerance * scale, msg=what)


def inputs(shape, dtype=torch.float32, layout=torch.contiguous_format, seed=1, mean=0.7):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 1.5 + mean
    grad_y = torch.randn(shape, generator=generator)
    return (t.to(DEVICE, dtype).contiguous(memory_format=layout) for t in (x, grad_y))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name, options", LAYERS, ids=IDS)
def test_the_fused_path_gives_the_autograd_paths_values(name, options, training, shape):
    layer = make(name, options, shape[1], training)
    x, grad_y = inputs(shape)
    fused = [None]

    def fused_step():
        fused[0] = run(copy.deepcopy(layer), x, grad_y)

    launches = count_dispatch(fused_step).operations
    assert launches[FORWARD_KERNEL[name]] == 1, launches  # the fused kernels ran
    assert_close(fused[0], run(copy.deepcopy(layer), x, grad_y, autograd_path), 3e-5)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name, options", LAYERS[::2], ids=IDS[::2])
def test_half_precision_is_the_float32_computation_rounded_once(name, options, dtype, layout):
    layer = make(name, options, 16, training=True)
    x, grad_y = inputs((2, 16, 4, 6), dtype, layout)
    half = run(copy.deepcopy(layer), x, grad_y)
    full = run(copy.deepcopy(layer), x.float(), grad_y.float())
    assert half[0].dtype == dtype and half[1]["x"].dtype == dtype
    assert half[0].is_contiguous(memory_format=layout) and half[1]["x"].is_contiguous(memory_format=layout)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(half[0].float(), full[0], rtol=eps, atol=eps)
    torch.testing.assert_close(half[1]["x"].float(), full[1]["x"], rtol=eps, atol=eps * full[1]["x"].abs().max().item())
    for key in set(full[1]) - {"x"}:  # parameters: float32 sums of the same rounded values
        torch.testing.assert_close(half[1][key], full[1][key], rtol=1e-5, atol=1e-5 * full[1][key].abs().max().item())


@pytest.mark.parametrize("name, options", LAYERS[::2], ids=IDS[::2])
def test_a_layer_converted_to_half_keeps_its_parameters_dtype_in_the_gradients(name, options):
    layer = make(name, options, 16, training=True).half()
    x, grad_y = inputs((2, 16, 4, 6), torch.float16)
    fused = run(copy.deepcopy(layer), x, grad_y)
    expected = run(copy.deepcopy(layer), x, grad_y, autograd_path)
    for key, grad in expected[1].items():
        assert fused[1][key].dtype == grad.dtype, key
    assert_close(fused, expected, 2e-3)


@pytest.mark.parametrize("seed", [0, 2, 3])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name, options", LAYERS[::2], ids=IDS[::2])
def test_large_channel_means_keep_the_autograd_paths_float32_accuracy(name, options, training, seed):
    # mean 1e4 times the spread: E[x^2] - E[x]^2 in float32 would keep no digit of the variance. The
    # float32 input's own rounding limits both paths alike (the means are 1e4 +- a few ulps): the fused path
    # must be as close to the float64 computation as the autograd path is, within a factor 2, for layers of
    # several draws (in evaluation the gradients go through running means far from the data's, the case
    # that needs the means' residuals and the kernels' pooled means kept as pairs)
    layer = make(name, options, 16, training, seed)
    x, grad_y = inputs((3, 16, 5, 6), mean=1e4)
    exact = run(copy.deepcopy(layer).double(), x.double(), grad_y.double(), autograd_path)
    fused = run(copy.deepcopy(layer), x, grad_y)
    plain = run(copy.deepcopy(layer), x, grad_y, autograd_path)

    def errors(result):
        tensors = {"output": result[0], **result[1], **result[2]}
        want = {"output": exact[0], **exact[1], **exact[2]}
        return {
            key: ((t.double() - want[key].double()).abs().max().item(), want[key].double().abs().max().item())
            for key, t in tensors.items()
        }

    plain_errors = errors(plain)
    for key, (fused_error, size) in errors(fused).items():
        plain_error = plain_errors[key][0]
        assert fused_error <= 2 * plain_error + 1e-6 * max(size, 1.0), (key, fused_error, plain_error)


def test_a_running_batch_average_takes_the_autograd_path_and_pools_exactly():
    layer = make("SN", {}, 8, training=True)
    batches = [next(inputs((2, 8, 3, 4), seed=seed)) for seed in range(3)]
    fused, plain = copy.deepcopy(layer), copy.deepcopy(layer)
    counts = count_dispatch(lambda: update_batch_average(fused, iter(batches), 3)).operations
    assert counts["triton:_forward_kernel"] == 0, counts
    pooled = torch.cat(batches)
    mean = pooled.mean((0, 2, 3))
    var = pooled.var((0, 2, 3), unbiased=False)
    torch.testing.assert_close(fused.running_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.running_var, var, rtol=1e-5, atol=1e-6)
    assert plain.running_mean.equal(layer.running_mean)  # the copies are independent


@pytest.mark.parametrize("name, options", LAYERS[::2], ids=IDS[::2])
def test_a_double_backward_replays_the_plain_computation(name, options):
    layer = make(name, options, 8, training=True)
    x, _ = inputs((2, 8, 3, 4))

    def penalty(forward):
        module = copy.deepcopy(layer)
        inp = x.detach().clone().requires_grad_()
        y = module(inp) if forward is None else forward(module, inp)
        (grad_x,) = torch.autograd.grad(y.square().sum(), inp, create_graph=True)
        grad_x.square().sum().backward()
        return [inp.grad] + [p.grad for p in module.parameters()] + [b.clone() for b in module.buffers()]

    for got, want in zip(penalty(None), penalty(autograd_path)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(want.abs().max().item(), 1.0))
