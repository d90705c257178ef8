"""The fast path of ``normalize_by_moments`` against its plain-autograd reference, for every layer that uses it.

The fast path computes the IN moments from single-read sums, runs one autograd node with a closed-form
backward and applies the per-(n, c) affine through BatchNorm's evaluation kernel; the reference takes
``torch.var_mean`` and lets autograd differentiate every op. Both must give the same outputs, the
same gradients for the input and every parameter, and the same running statistics.
"""

import copy
import functools

import pytest
import torch

from sn_detection.layers import build_norm
from sn_detection.layers.map_passes import TorchPasses, plain_moments
from sn_detection.layers.moment_normalizer import normalize_by_moments, reference_normalize_by_moments

FAST_PATH_LAYERS = ["SN", "SyncSN", "DN", "MN", "MGN"]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


def perturbed(name, channels, dtype, seed=0):
    torch.manual_seed(seed)
    layer = build_norm(name, channels).to(dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return layer


def reference_forward(layer, x):
    affine = functools.partial(layer.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])
    return reference_normalize_by_moments(x, affine)


def forward_backward(forward, layer, x, grad_y):
    x = x.clone().requires_grad_()
    y = forward(layer, x)
    y.backward(grad_y)
    grads = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return y.detach(), grads, {name: b.clone() for name, b in layer.named_buffers()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", FAST_PATH_LAYERS)
def test_fast_path_matches_reference(name, training, dtype):
    layer = perturbed(name, 16, dtype).train(training)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, 7, 9, generator=generator, dtype=dtype) * 1.5 + 0.7
    grad_y = torch.randn(x.shape, generator=generator, dtype=dtype)
    fast_layer, reference_layer = layer, copy.deepcopy(layer)

    fast = forward_backward(lambda module, inp: module(inp), fast_layer, x, grad_y)
    reference = forward_backward(reference_forward, reference_layer, x, grad_y)

    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(fast[0], reference[0], rtol=tolerance, atol=tolerance)
    assert fast[1].keys() == reference[1].keys()
    for key, grad in reference[1].items():
        assert grad is not None and fast[1][key] is not None, key
        torch.testing.assert_close(fast[1][key], grad, rtol=tolerance, atol=tolerance, msg=key)
    for key, buffer in reference[2].items():
        torch.testing.assert_close(fast[2][key], buffer, rtol=tolerance, atol=tolerance, msg=key)


def test_gradcheck_of_fast_path_with_a_generic_affine():
    # an affine that mixes samples and channels, so every cross term of the closed-form backward counts
    weight = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def affine(mean, var):
        pooled = (var + mean.square()).mean(0, keepdim=True) - mean.mean(0, keepdim=True).square()
        scale = weight * torch.rsqrt(0.5 * var + 0.5 * pooled + 1e-3)
        return scale, torch.tanh(mean.mean(1, keepdim=True)) - mean * scale

    x = torch.randn(3, 4, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp, w: normalize_by_moments(inp, affine, (w,)), (x, weight))


def test_moments_stay_accurate_when_the_mean_dwarfs_the_spread():
    generator = torch.Generator().manual_seed(0)
    x = 1e3 + 0.01 * torch.randn(2, 3, 40, 40, generator=generator)
    x[:, 1] = torch.randn(2, 40, 40, generator=generator)  # a well-conditioned channel beside them
    expected_var, expected_mean = torch.var_mean(x.double(), dim=(2, 3), correction=0)
    mean, var, _ = plain_moments(x)
    torch.testing.assert_close(mean.double(), expected_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(var.double(), expected_var, rtol=1e-3, atol=0)


def test_the_residual_holds_what_rounding_took_off_an_ill_conditioned_mean():
    generator = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(2, 3, 5, 6, generator=generator)
    x[:, 1] = torch.randn(2, 5, 6, generator=generator)  # well-conditioned: no residual
    exact = x.double().mean((2, 3))
    mean, var, residual = plain_moments(x)
    assert all(torch.equal(a, b) for a, b in zip((mean, var), TorchPasses.moments(x)))
    rounding = (mean.double() - exact)[:, [0, 2]].abs()
    assert rounding.max() > 1e-5  # rounding near 1e4 takes off up to 4.9e-4: there is something to keep
    assert (mean.double() + residual.double() - exact)[:, [0, 2]].abs().max() < 1e-7 * rounding.max() + 1e-9
    assert (residual[:, 1] == 0).all()


def test_grad_input_at_the_exact_mean_matches_autograd_through_the_rounded_mean():
    """p (x - mean - residual) + q is the derivative of var_in at the exact mean; autograd through the
    rounded mean gets the same from the deviations' nonzero sum. A mean 1e4 times the spread."""
    generator = torch.Generator().manual_seed(2)
    x = 1e4 + torch.randn(2, 3, 4, 5, generator=generator)
    grad_var = torch.randn(2, 3, generator=generator)
    xd = x.double().requires_grad_()
    (exact,) = torch.autograd.grad((xd.var((2, 3), correction=0) * grad_var.double()).sum(), xd)
    mean, _, residual = plain_moments(x)
    p, q = 2 * grad_var / 20, torch.zeros_like(grad_var)
    zeros = torch.zeros_like(x)
    scale = zeros[:, :, 0, 0]
    with_residual = TorchPasses.grad_input(zeros, x, (scale,), (p, q), (mean, None, residual), True)
    without = TorchPasses.grad_input(zeros, x, (scale,), (p, q), (mean,), False)
    error, error_without = ((g.double() - exact).abs().max().item() for g in (with_residual, without))
    assert error < 1e-5 * exact.abs().max().item() and error < error_without / 10, (error, error_without)


def test_backward_can_run_twice_with_retained_graph():
    layer = perturbed("SN", 8, torch.float64).train()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    y = layer(x).square().sum()
    (first,) = torch.autograd.grad(y, x, retain_graph=True)
    (second,) = torch.autograd.grad(y, x)
    torch.testing.assert_close(first, second)


def test_channels_last_input_takes_the_same_values():
    layer = perturbed("SN", 8, torch.float32).train()
    x = torch.randn(2, 8, 5, 6)
    expected = copy.deepcopy(layer)(x)
    torch.testing.assert_close(layer(x.to(memory_format=torch.channels_last)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FAST_PATH_LAYERS)
def test_output_can_be_modified_in_place(name):
    # detectron2 applies relu_ to norm outputs; the custom autograd node must allow it
    layer = perturbed(name, 8, torch.float64).train()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    y = torch.relu_(layer(x))
    y.sum().backward()
    expected = copy.deepcopy(perturbed(name, 8, torch.float64).train())
    x_ref = x.detach().clone().requires_grad_()
    torch.relu(reference_forward(expected, x_ref)).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fast_path_runs_where_batch_norm_refuses_a_zero_eps(dtype, monkeypatch):
    # torch 2.11's F.batch_norm raises for eps <= 0 even in evaluation mode, which the PyTorch path's fused
    # affine pass (BatchNorm's evaluation kernel, variance 1) once passed; the eps it passes instead must
    # leave the values those of the reference
    batch_norm = torch.nn.functional.batch_norm

    def refusing_zero_eps(*args, **kwargs):
        eps = kwargs["eps"] if "eps" in kwargs else args[7]
        if eps <= 0.0:
            raise ValueError(f"batch_norm eps must be positive, but got {eps}")
        return batch_norm(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "batch_norm", refusing_zero_eps)
    layer = perturbed("SN", 16, dtype).train()
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 16, 7, 9, generator=generator, dtype=dtype) * 1.5 + 0.7
    grad_y = torch.randn(x.shape, generator=generator, dtype=dtype)
    fast = forward_backward(lambda module, inp: module(inp), copy.deepcopy(layer), x, grad_y)
    reference = forward_backward(reference_forward, layer, x, grad_y)
    torch.testing.assert_close(fast[0], reference[0], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    torch.testing.assert_close(fast[1]["x"], reference[1]["x"], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
