"""TorchScript export of every layer of ``build_norm``.

A layer is scripted, saved and loaded again (saving fails on anything TorchScript can only call back
into Python for, such as an autograd Function), and the loaded module is compared with the eager layer:
same outputs in evaluation mode, and in training mode the same outputs, gradients and running
statistics.
"""

import copy
import io

import pytest
import torch
from layer_state import tensors

from sn_detection.layers import NORM_NAMES, SyncSwitchableNorm2d, build_norm, norm_options

CHANNELS = 8
# DN and MN keep their batch-average state in an instance attribute that is None outside a batch
# average; TorchScript reads it as None (and warns that it cannot use its annotation).
pytestmark = pytest.mark.filterwarnings("ignore:The TorchScript type system doesn't support instance-level")
# SyncSN's (and SyncSSN's) training forward all-reduces through torch.distributed, which TorchScript cannot
# compile (see test_scripted_sync_sn_refuses_training_with_a_clear_error).
SCRIPTABLE_IN_TRAINING = [name for name in NORM_NAMES if name not in ("SyncSN", "SyncSSN")]


def make(name, training):
    """A layer with perturbed parameters, after two training batches (so running statistics moved)."""
    options = {"num_groups": 4} if "num_groups" in norm_options(name) else {}
    torch.manual_seed(0)
    layer = build_norm(name, CHANNELS, **options).train()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
        for seed in range(2):
            layer(features(4, seed=10 + seed))
    return layer.train(training)


def features(n, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, CHANNELS, 5, 6, generator=generator) * 2 + 0.5


def saved_and_loaded(module):
    """``module`` scripted, then through torch.jit.save and torch.jit.load."""
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    buffer.seek(0)
    return torch.jit.load(buffer)


def assert_same_state(got, expected):
    got, expected = got.state_dict(), tensors(expected)  # TorchScript saves no identity (layers.base)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", NORM_NAMES)
def test_scripted_layer_matches_eager_in_evaluation(name):
    eager = make(name, training=False)
    scripted = saved_and_loaded(copy.deepcopy(eager))
    assert not scripted.training
    for n in (0, 1, 3):
        torch.testing.assert_close(scripted(features(n, seed=n)), eager(features(n, seed=n)), rtol=1e-6, atol=1e-6)
    assert_same_state(scripted, eager)


@pytest.mark.parametrize("name", SCRIPTABLE_IN_TRAINING)
def test_scripted_layer_matches_eager_in_training(name):
    """In float64: the scripted layer's gradients come from autograd through plain operations, the eager
    one's from closed-form backward passes; in float32 they differ by rounding (~1e-6)."""
    eager = make(name, training=True).double()
    scripted = saved_and_loaded(copy.deepcopy(eager))
    assert scripted.training
    weights = features(3, seed=5).double()
    results = []
    for module in (eager, scripted):
        x = features(3, seed=4).double().requires_grad_()
        y = module(x)
        (y * weights).sum().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in module.parameters()])
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert_same_state(scripted, eager)  # running statistics updated alike


@pytest.mark.parametrize("name", NORM_NAMES)  # every layer freezes (layers.base)
def test_frozen_layer_scripts_in_evaluation(name):
    eager = make(name, training=True).freeze()
    scripted = saved_and_loaded(copy.deepcopy(eager))
    assert not scripted.training
    torch.testing.assert_close(scripted(features(2)), eager(features(2)), rtol=1e-6, atol=1e-6)


def test_scripted_sync_sn_refuses_training_with_a_clear_error():
    """In evaluation mode it is scripted like SN (see above); a training forward would have to all-reduce."""
    scripted = saved_and_loaded(SyncSwitchableNorm2d(CHANNELS).train())
    with pytest.raises(torch.jit.Error, match="SyncSwitchableNorm2d cannot all-reduce under TorchScript"):
        scripted(features(2))
