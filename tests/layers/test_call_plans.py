"""A layer decides its path once per input signature and keeps that plan for the calls that follow
(``base.NormBase.call_plan``): the same results as a layer deciding anew, a new plan wherever the decision
could differ, a bounded number of them, none in copies and pickles."""

import copy
import io
import pickle

import pytest
import torch

from sn_detection.layers import NORM_NAMES, NormBase, build_norm

PLANNED = [name for name in NORM_NAMES if name != "GN"]  # GN is torch's GroupNorm: nothing to decide


@pytest.fixture
def made(monkeypatch):
    """The inputs each layer class made a plan for, in order."""
    inputs = []
    # the classes that define it (each layer's own, or the one it inherits), each patched once
    classes = {next(c for c in type(build_norm(name, 8)).__mro__ if "make_call_plan" in vars(c)) for name in PLANNED}
    for cls in classes:
        original = cls.make_call_plan

        def recorded(self, x, original=original):
            inputs.append((tuple(x.shape), x.dtype, x.stride(), self.training))
            return original(self, x)

        monkeypatch.setattr(cls, "make_call_plan", recorded)
    return inputs


def perturbed(name, channels=8):
    torch.manual_seed(0)
    layer = build_norm(name, channels)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return layer


def step(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(torch.ones_like(y))
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()] + [b.clone() for b in layer.buffers()]


@pytest.mark.parametrize("name", PLANNED)
def test_a_plan_is_made_once_per_input_signature_and_mode(name, made):
    layer = build_norm(name, 8)
    x = torch.randn(2, 8, 3, 4)
    for _ in range(3):
        layer(x)
    layer(x.to(memory_format=torch.channels_last))
    layer(torch.randn(3, 8, 3, 4))
    layer(x.double())
    layer.eval()
    layer(x)
    layer.train()
    layer(x)
    signatures = [((2, 8, 3, 4), torch.float32, x.stride(), True)]
    assert made == signatures + [
        ((2, 8, 3, 4), torch.float32, x.to(memory_format=torch.channels_last).stride(), True),
        ((3, 8, 3, 4), torch.float32, (96, 12, 4, 1), True),
        ((2, 8, 3, 4), torch.float64, x.stride(), True),
        ((2, 8, 3, 4), torch.float32, x.stride(), False),
    ]


@pytest.mark.parametrize("name", PLANNED)
def test_planned_calls_compute_what_a_layer_deciding_anew_computes(name):
    """Training and evaluation, two shapes, interleaved: each call of the planning layer matches a fresh copy
    of it (whose first call decides its path) in output, gradients and running statistics. (On the kernel
    path too: the kernel-test environment runs this test.)"""
    layer = perturbed(name)
    inputs = [torch.randn(2, 8, 3, 4) * 2 + 1, torch.randn(4, 8, 2, 2) - 1]
    for training in (True, False, True):
        for x in inputs:
            layer.train(training)
            fresh = copy.deepcopy(layer)  # no plans: it decides anew
            for parameter in (*layer.parameters(), *fresh.parameters()):
                parameter.grad = None
            for got, want in zip(step(layer, x), step(fresh, x)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_plans_are_bounded(made):
    layer = build_norm("SN", 8)
    for n in range(1, 41):
        layer(torch.randn(n, 8, 2, 2))
    assert len(made) == 40
    assert 0 < len(layer.__dict__["_call_plans"]) <= 16
    layer(torch.randn(40, 8, 2, 2))  # the latest are kept
    assert len(made) == 40


@pytest.mark.parametrize("name", PLANNED)
def test_copies_and_pickles_start_without_plans_and_keep_the_state(name, made):
    layer = perturbed(name)
    x = torch.randn(2, 8, 3, 4)
    layer(x)
    assert len(made) == 1
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert "_call_plans" not in other.__dict__
        torch.testing.assert_close(other.state_dict(), layer.state_dict(), rtol=0, atol=0)
        other(x)
    assert len(made) == 3
    buffer = io.BytesIO()
    torch.save(layer, buffer)  # the whole module, as torch.save(model) does
    buffer.seek(0)
    assert "_call_plans" not in torch.load(buffer, weights_only=False).__dict__


@pytest.mark.parametrize("change", ["double", "to", "new parameter", "batch average"])
def test_what_a_plan_depends_on_clears_the_plans(change, made):
    layer = build_norm("SN", 8)
    x = torch.randn(2, 8, 3, 4)
    layer(x)
    if change == "double":
        layer.double()
        x = x.double()
    elif change == "to":
        layer.to(torch.float16).float()
    elif change == "new parameter":
        layer.weight = torch.nn.Parameter(torch.ones(8))
    else:
        layer.start_batch_average()
    layer(x)
    assert len(made) == 2
    if change == "batch average":
        assert layer.call_plan(x) is None  # the autograd path pools the batch average's float64 sums
        layer.finish_batch_average()
        layer(x)
        assert len(made) == 3 and layer.call_plan(x) is not None


@pytest.mark.parametrize("name", PLANNED)
def test_bad_input_is_refused_on_every_call(name, made):
    layer = build_norm(name, 8)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"expected input of shape \(N, 8, H, W\)"):
            layer(torch.randn(2, 4, 3, 3))
        with pytest.raises(TypeError, match="floating-point"):
            layer(torch.ones(2, 8, 3, 3, dtype=torch.long))
    assert "_call_plans" not in layer.__dict__ or not layer.__dict__["_call_plans"]


def test_every_planned_layer_plans(made):
    for name in PLANNED:
        layer = build_norm(name, 8)
        assert isinstance(layer, NormBase)
        layer(torch.randn(2, 8, 2, 2))
    assert len(made) == len(PLANNED)


@pytest.mark.parametrize("name", PLANNED)
def test_a_layer_with_plans_scripts(name):
    """TorchScript compiles no plan (host-side Python): it skips the attribute that holds them."""
    layer = perturbed(name).eval()
    x = torch.randn(2, 8, 3, 4)
    eager = layer(x)
    assert layer.__dict__["_call_plans"]
    torch.testing.assert_close(torch.jit.script(layer)(x), eager)
