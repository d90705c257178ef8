"""fp32 accuracy at the level of torch's BatchNorm whatever a channel's mean-to-spread ratio (up to 1e4),
and exact second derivatives (gradgradcheck in float64) for every layer.

Accuracy is measured as torch measures itself: a layer's fp32 output (and input gradient) against the
same layer in float64 on the same values, beside BatchNorm2d's own fp32 error on those values. Inputs
are drawn in fp32, so that both precisions see exactly the same data."""

import copy

import pytest
import torch
from torch import nn

from sn_detection.layers import NORM_NAMES, build_norm, update_batch_average

RATIOS = [1, 3, 10, 100, 1e3, 1e4]
DTYPES = (torch.float32, torch.float64)
OPTIONS = {"GN": {"num_groups": 8}, "BNSR": {"p": 1.0}}  # BNSR at p = 1: its slope near 0 is BN's


def layer_and_batch_norm(name, ratio):
    """The layer and BatchNorm2d in float64, with the running statistics of data like the test's (the
    batch average), so that evaluation mode normalizes with realistic ones."""
    torch.manual_seed(0)
    layer = build_norm(name, 32, **OPTIONS.get(name, {})).double()
    batch_norm = nn.BatchNorm2d(32).double()
    batches = [(torch.randn(4, 32, 9, 11) + ratio).double() for _ in range(4)]
    for module in (layer, batch_norm):
        update_batch_average(module, iter(batches), num_batches=len(batches))
    return layer, batch_norm


def errors(layer, x, grad_y):
    """Largest |fp32 - float64| of the output, and of the input gradient relative to its largest value."""
    results = []
    for dtype in DTYPES:
        inp = x.to(dtype).detach().requires_grad_()
        y = copy.deepcopy(layer).to(dtype)(inp)
        y.backward(grad_y.to(dtype))
        results.append((y.detach().double(), inp.grad.double()))
    (y32, g32), (y64, g64) = results
    return (y32 - y64).abs().max().item(), ((g32 - g64).abs().max() / g64.abs().max()).item()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", NORM_NAMES)
def test_fp32_is_as_accurate_as_batch_norm(name, ratio, training):
    layer, batch_norm = layer_and_batch_norm(name, ratio)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, 9, 11, generator=generator) + ratio
    grad_y = torch.randn(x.shape, generator=generator)
    output, gradient = errors(layer.train(training), x, grad_y)
    bn_output, _ = errors(batch_norm.train(training), x, grad_y)
    # the gradient against BatchNorm's in training, where it goes through the statistics (in evaluation
    # BatchNorm's is a mere product, while SN's IN and LN branches still differentiate statistics)
    _, bn_gradient = errors(batch_norm.train(), x, grad_y)
    # a small multiple of BatchNorm's own error; at ratios near 1 both are at fp32's rounding of the output
    assert output <= max(4 * bn_output, 1e-5), (output, bn_output)
    assert gradient <= max(10 * bn_gradient, 1e-5), (gradient, bn_gradient)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", NORM_NAMES)
def test_fp32_without_gradients_is_as_accurate_as_batch_norm(name, ratio, training):
    """The same bound under ``torch.no_grad()``, where the layers take their gradient-free passes (in place,
    fewer allocations) rather than the differentiable ones above."""
    layer, batch_norm = layer_and_batch_norm(name, ratio)
    x = torch.randn(4, 32, 9, 11, generator=torch.Generator().manual_seed(1)) + ratio

    def error(module):
        with torch.no_grad():
            outputs = [copy.deepcopy(module).train(training).to(dtype)(x.to(dtype)).double() for dtype in DTYPES]
        return (outputs[0] - outputs[1]).abs().max().item()

    output, bn_output = error(layer), error(batch_norm)
    assert output <= max(4 * bn_output, 1e-5), (output, bn_output)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    "name,ratio,limit", [("MGN", 10, 2e-3), ("MGN", 100, 2e-2), ("MGN", 1e3, 0.2), ("MN", 10, 1e-2)]
)
def test_gate_gradients_lose_digits_only_in_proportion_to_the_mean(name, ratio, limit, training):
    """The gate logits of MN and MGN are linear in the channel means, so their gate weight's gradient (the
    logits' gradients times those means) is conditioned by mean / spread, and its fp32 error relative to
    its largest value grows with that ratio, no faster: MGN's mode means are taken relative to the
    sample's average and MN's terms relative to the sample's most likely mode, so that the softmaxes'
    backward has no common part to cancel (MN's, in float64, also none from its float64 mode sums)."""
    layer, _ = layer_and_batch_norm(name, ratio)
    layer.train(training)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, 9, 11, generator=generator) + ratio
    grad_y = torch.randn(x.shape, generator=generator)
    grads = []
    for dtype in (torch.float32, torch.float64):
        copied = copy.deepcopy(layer).to(dtype)
        copied(x.to(dtype)).backward(grad_y.to(dtype))
        grads.append(copied.gate.weight.grad.double())
    error = ((grads[0] - grads[1]).abs().max() / grads[1].abs().max()).item()
    assert error <= limit, error


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", NORM_NAMES)
def test_second_derivatives_are_exact(name, training):
    """create_graph=True: a gradient penalty reaches the input and every parameter (gradgradcheck)."""
    torch.manual_seed(0)
    layer = build_norm(name, 4, **({"num_groups": 2} if name == "GN" else {})).double()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
        layer.train()(torch.randn(3, 4, 3, 3, dtype=torch.float64))  # running statistics away from 0, 1
    layer.train(training)
    # DN's gates are straight-through: their gradient is by design not the derivative (tests/layers/test_dynamic.py)
    checked = {key: p for key, p in layer.named_parameters() if key not in ("channel_gates", "batch_gate")}
    names = list(checked)
    values = [p.detach().clone().requires_grad_() for p in checked.values()]
    x = (torch.randn(2, 4, 2, 3, dtype=torch.float64) * 1.5 + 0.5).requires_grad_()

    def forward(inp, *parameters):
        return torch.func.functional_call(layer, dict(zip(names, parameters)), (inp,))

    assert torch.autograd.gradgradcheck(forward, (x, *values))


def test_running_statistics_are_not_recorded_twice_by_a_double_backward():
    layer = build_norm("SN", 4).double().train()
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    tracked = layer.num_batches_tracked.clone(), layer.running_mean.clone()
    (grad,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    grad.square().sum().backward()
    assert layer.num_batches_tracked == tracked[0] and torch.equal(layer.running_mean, tracked[1])
