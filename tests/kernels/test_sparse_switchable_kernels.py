"""SSN on SN's fused kernels with SparsestMax as their mapping (``switchable_kernels``, MAPPING SPARSESTMAX): in
every regime of SparsestMax (the sparsemax, the circle, the edge, the vertex, the centre, fixed weights) the
kernels give the values of the reference path (autograd through the layer's tensor operations) and of the
closed forms as tensor operations: the output, every gradient (the logits' through the vector-Jacobian product
the kernels compute) and every buffer, the fixed branches included; and the kernels fix one-hot weights in
their forward without waiting for the device.

Runs where tests/kernels/test_map_passes.py runs (a CUDA GPU, or the CPU under Triton's interpreter).
"""

import copy
import functools
import os

import pytest
import torch

from sn_detection.benchmarks.launch_counts import count_dispatch, count_training_step
from sn_detection.layers import build_norm
from sn_detection.layers.fused import fused_normalize
from sn_detection.layers.moment_normalizer import reference_normalize_by_moments
from sn_detection.layers.switchable_kernels import SwitchableClosedForms, SwitchableKernels

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
# (mean logits, variance logits, radius, fixed branches): every regime of SparsestMax for the means, and
# another one for the variances
STATES = {
    "sparsemax": ([0.9, 1.3, 0.8], [1.2, 0.7, 1.1], 0.0, (-1, -1)),
    "circle": ([0.9, 1.3, 0.8], [0.4, 0.3, 0.1], 0.3, (-1, -1)),
    "edge": ([0.4, 0.3, 0.1], [0.9, 1.3, 0.8], 0.55, (-1, -1)),
    "centre": ([1.0, 1.0, 1.0], [0.1, 0.5, 0.45], 0.3, (-1, -1)),
    "vertex": ([0.4, 0.3, 0.1], [0.9, 1.3, 0.8], 0.85, (-1, -1)),
    "sparsemax-one-hot": ([3.0, 0.2, 0.1], [1.2, 0.7, 1.1], 0.2, (-1, -1)),
    "fixed": ([0.4, 0.3, 0.1], [0.9, 1.3, 0.8], 0.3, (1, -1)),
    "both-fixed": ([0.4, 0.3, 0.1], [0.9, 1.3, 0.8], 0.3, (2, 0)),
}


def make(state, use_bn, training, name="SSN", channels=16):
    mean_logits, var_logits, radius, fixed = STATES[state]
    k = 3 if use_bn else 2
    torch.manual_seed(0)
    layer = build_norm(name, channels, use_bn=use_bn)
    with torch.no_grad():
        layer.weight.add_(0.3 * torch.randn(channels))
        layer.bias.add_(0.3 * torch.randn(channels))
        layer.mean_weight.copy_(torch.tensor(mean_logits[:k]))
        layer.var_weight.copy_(torch.tensor(var_logits[:k]))
        if use_bn:
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
    layer.set_radius(radius, iteration=17)
    layer.mean_fixed.fill_(min(fixed[0], k - 1))
    layer.var_fixed.fill_(min(fixed[1], k - 1))
    return layer.to(DEVICE).train(training)


def inputs(shape=(3, 16, 5, 7), seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 1.5 + 0.7
    return x.to(DEVICE), torch.randn(shape, generator=generator).to(DEVICE)


def reference_path(layer, x):
    """The layer's tensor operations differentiated by autograd, after the rule of a training forward."""
    if layer.training:
        layer.fix_one_hot_weights()
    affine = functools.partial(layer.scale_and_shift, spatial_size=x.shape[2] * x.shape[3])
    return reference_normalize_by_moments(x, affine)


def closed_forms(layer, x):
    """The closed forms as tensor operations on the same float32 input, after the rule of a training forward."""
    if layer.training:
        layer.fix_one_hot_weights()
    return fused_normalize(layer, SwitchableClosedForms(layer, x), x, layer.parameter_tuple(), True)


def run(layer, x, grad_y, forward=None):
    x = x.detach().clone().requires_grad_()
    y = layer(x) if forward is None else forward(layer, x)
    y.backward(grad_y)
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in layer.named_parameters()}
    return y.detach(), {"x": x.grad, **grads}, {name: b.clone() for name, b in layer.named_buffers()}


def assert_close(actual, expected, tolerance=3e-5):
    for got, want, what in [(actual[0], expected[0], "output")] + [
        (actual[i][key], want, key) for i in (1, 2) for key, want in expected[i].items()
    ]:
        scale = max(want.double().abs().max().item(), 1.0)
        torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=tolerance * scale, msg=what)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("use_bn", [True, False], ids=["bn", "no-bn"])
@pytest.mark.parametrize("state", STATES)
def test_the_kernels_give_the_reference_and_the_closed_forms_values(state, use_bn, training):
    layer = make(state, use_bn, training)
    x, grad_y = inputs()
    assert isinstance(layer.call_plan(x), SwitchableKernels)
    kernels = run(copy.deepcopy(layer), x, grad_y)
    assert_close(kernels, run(copy.deepcopy(layer), x, grad_y, reference_path))
    assert_close(kernels, run(copy.deepcopy(layer), x, grad_y, closed_forms))
    buffers = kernels[2]
    if training and state in ("vertex", "sparsemax-one-hot"):  # fixed by the forward kernel, at the iteration set
        assert buffers["mean_fixed"].item() == 0 and buffers["mean_fixed_at"].item() == 17
    elif STATES[state][3][0] < 0:
        assert buffers["mean_fixed"].item() == -1 and buffers["mean_fixed_at"].item() == -1


@pytest.mark.parametrize("seed", range(4))
def test_the_kernels_vector_jacobian_product_is_autograds_over_random_logits(seed):
    generator = torch.Generator().manual_seed(seed)
    x, grad_y = inputs((2, 8, 3, 4), seed=seed)
    for radius in (0.0, 0.2, 0.4, 0.6):
        layer = make("sparsemax", True, True, channels=8)
        with torch.no_grad():
            layer.mean_weight.copy_(torch.rand(3, generator=generator) * 2)
            layer.var_weight.copy_(torch.rand(3, generator=generator) * 2)
        layer.set_radius(radius)
        assert_close(run(copy.deepcopy(layer), x, grad_y), run(copy.deepcopy(layer), x, grad_y, reference_path))


@pytest.mark.parametrize("name", ["SSN", "SyncSSN"])
def test_a_training_step_that_fixes_its_weights_runs_sns_kernels_without_waiting(name):
    layer = make("vertex", True, True, name=name, channels=64)
    counts = count_training_step(layer, *inputs((2, 64, 3, 5)))
    assert counts.syncs == 0, counts.operations
    assert sum(n for op, n in counts.operations.items() if op.startswith("triton:")) == 6, counts.operations
    assert (layer.mean_fixed.item(), layer.var_fixed.item(), layer.mean_fixed_at.item()) == (0, 1, 17)


def test_the_fixed_buffers_written_in_place_refuse_a_stale_backward():
    # like the running statistics: autograd knows the kernel wrote them
    layer = make("vertex", True, True)
    x, _ = inputs()
    y = layer(x.requires_grad_())
    assert layer.mean_fixed._version > 0 and layer.var_fixed_at._version > 0
    y.sum().backward()


def test_evaluation_fixes_nothing_on_the_kernels():
    layer = make("vertex", True, False)
    with torch.no_grad():
        counts = count_dispatch(lambda: layer(inputs()[0]))
    assert counts.syncs == 0 and layer.mean_fixed.item() == -1
