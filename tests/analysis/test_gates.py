"""MN / MGN gate statistics observed on inputs: hand-set gates come back exactly, and gates of inputs with
known channel means are the paper's softmax(Psi(mean))."""

import math

import pytest
import torch
from torch import nn

from sn_detection.analysis import GateRecorder, ModeGates, gate_probabilities
from sn_detection.layers import ModeGroupNorm2d, ModeNorm2d


def constant_gates(layer, probabilities):
    """Gate weights 0 and biases log(p): every assignment is exactly p."""
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.bias.copy_(torch.tensor(probabilities).log())
    return layer


def entropy(p):
    return -sum(q * math.log(q) for q in p) / math.log(len(p))


class TwoModes(nn.Module):
    def __init__(self):
        super().__init__()
        self.mn = constant_gates(ModeNorm2d(4, num_modes=2), [0.7, 0.3])
        self.mgn = ModeGroupNorm2d(3, num_modes=2)
        self.unused = ModeNorm2d(4)

    def forward(self, x):
        return self.mgn(self.mn(x)[:, :3])


def test_hand_set_gates_are_reported_exactly():
    model = TwoModes()
    with torch.no_grad():
        model.mgn.gate.weight.copy_(torch.tensor([[2.0], [-1.0]]))
        model.mgn.gate.bias.copy_(torch.tensor([0.5, 0.0]))
    with GateRecorder(model) as recorder, torch.no_grad():
        model(torch.randn(2, 4, 5, 5))
        model(torch.randn(3, 4, 6, 4))
        model(torch.randn(0, 4, 5, 5))  # empty inputs are not assignments
    mn, mgn, unused = recorder.results()
    assert (mn.layer, mn.kind, mn.channels, mn.num_modes, mn.assignments) == ("mn", "MN", 4, 2, 5)
    assert mn.mode_probabilities == pytest.approx((0.7, 0.3), abs=1e-6)
    assert mn.entropy == pytest.approx(entropy([0.7, 0.3]), abs=1e-6)
    assert mn.dominant_probability == pytest.approx(0.7, abs=1e-6)
    # MGN: one assignment per (sample, channel), 5 samples x 3 channels
    assert (mgn.kind, mgn.assignments) == ("MGN", 15)
    assert sum(mgn.mode_probabilities) == pytest.approx(1.0)
    assert unused == ModeGates("unused", "MN", 4, 2)


def test_mgn_gates_of_channels_with_known_means():
    layer = ModeGroupNorm2d(2, num_modes=2)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.tensor([[1.0], [-1.0]]))
        layer.gate.bias.zero_()
    x = torch.ones(1, 2, 3, 3)
    x[:, 1] = -0.5  # channel means 1 and -0.5: logits (1, -1) and (-0.5, 0.5)
    first = torch.softmax(torch.tensor([1.0, -1.0]), 0)
    second = torch.softmax(torch.tensor([-0.5, 0.5]), 0)
    with GateRecorder(layer) as recorder:
        layer(x)
    (record,) = recorder.results()
    assert record.mode_probabilities == pytest.approx(((first + second) / 2).tolist(), abs=1e-6)
    assert record.dominant_probability == pytest.approx((first.max() + second.max()).item() / 2, abs=1e-6)


def test_mn_gates_of_samples_with_known_means():
    """Alg. 1: g_n = softmax(W s_n + b), s_n the sample's channel means."""
    layer = ModeNorm2d(2, num_modes=2)
    weight, bias = torch.tensor([[1.0, -2.0], [0.5, 0.0]]), torch.tensor([0.0, 0.3])
    with torch.no_grad():
        layer.gate.weight.copy_(weight)
        layer.gate.bias.copy_(bias)
    means = torch.tensor([[1.0, 0.5], [-1.0, 2.0]])
    x = means[:, :, None, None] + torch.tensor([[0.5, -0.5], [-0.5, 0.5]])  # spread around the means
    expected = torch.softmax(means @ weight.t() + bias, dim=1)
    with GateRecorder(layer) as recorder:
        layer(x)
    (record,) = recorder.results()
    assert record.mode_probabilities == pytest.approx(expected.mean(0).tolist(), abs=1e-6)
    assert record.dominant_probability == pytest.approx(expected.max(1).values.mean().item(), abs=1e-6)
    plogp = (expected * expected.log()).sum(1)
    assert record.entropy == pytest.approx((-plogp / math.log(2)).mean().item(), abs=1e-6)


def test_the_recorder_stops_recording_on_exit():
    layer = constant_gates(ModeNorm2d(4), [0.5, 0.5])
    with GateRecorder(layer) as recorder:
        layer(torch.randn(2, 4, 3, 3))
    layer(torch.randn(2, 4, 3, 3))
    assert recorder.results()[0].assignments == 2
    assert layer._forward_pre_hooks == {}


def test_gate_probabilities_needs_a_mode_layer():
    with pytest.raises(TypeError, match="ModeNorm2d or ModeGroupNorm2d, got Linear"):
        gate_probabilities(nn.Linear(2, 2), torch.zeros(1, 2, 1, 1))
