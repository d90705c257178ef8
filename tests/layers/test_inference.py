"""Every layer's evaluation form (``layers.inference``) computes what the layer computes in evaluation mode,
and reduces to what its equations say it reduces to: a constant affine (DN with the batch gate on, MN with
one mode, BNSR's standardization, torch's BatchNorm), GN (DN pooling contiguous groups), or the layer
itself. A constant affine folded into a convolution gives the convolution followed by the layer."""

import pytest
import torch
from torch import nn

from sn_detection.layers import (
    NORM_NAMES,
    DynamicNorm2d,
    GroupNorm2d,
    ModeNorm2d,
    SkewnessReducedBatchNorm2d,
    build_norm,
)
from sn_detection.layers.inference import ChannelAffine, EvaluationForm, evaluation_form, fold_into_conv
from sn_detection.layers.skewness import SignedPowerAffine
from sn_detection.layers.switchable import FrozenSwitchableNorm2d

CHANNELS = 32


def trained(layer: nn.Module, seed: int = 0) -> nn.Module:
    """``layer`` with random parameters and running statistics from three training batches, in evaluation."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5 + parameter)
        layer.train()
        for _ in range(3):
            layer(torch.randn(4, CHANNELS, 6, 5, generator=generator) * 2 + 3)
    return layer.eval()


def sample(seed: int = 1, shape=(3, CHANNELS, 7, 9)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * 1.5 - 2


def apply_form(form: EvaluationForm, x: torch.Tensor) -> torch.Tensor:
    for part in form:
        if part is not None:
            x = part(x)
    return x


@pytest.mark.parametrize("name", NORM_NAMES)
def test_every_layers_form_computes_the_layer_in_evaluation(name):
    layer = trained(build_norm(name, CHANNELS))
    form = evaluation_form(layer)
    x = sample()
    with torch.no_grad():
        torch.testing.assert_close(apply_form(form, x), layer(x), rtol=1e-5, atol=1e-5)


def set_dn_gates(layer: DynamicNorm2d, groups: int, batch: bool, strided: bool = False) -> DynamicNorm2d:
    with torch.no_grad():
        logits = layer._initial_channel_logits(groups)
        if strided:  # the coarsest gate alone: channels c and c + C / 2 pooled, not contiguous
            logits = -torch.ones_like(logits)
            logits[-1] = 1.0
        layer.channel_gates.copy_(logits)
        layer.batch_gate.fill_(1.0 if batch else -1.0)
    return layer


def test_dn_with_the_batch_gate_on_is_a_constant_affine():
    layer = set_dn_gates(trained(DynamicNorm2d(CHANNELS)), groups=4, batch=True)
    affine, module = evaluation_form(layer)
    assert isinstance(affine, ChannelAffine) and module is None
    x = sample()
    with torch.no_grad():
        torch.testing.assert_close(affine(x), layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 4, CHANNELS])
def test_dn_pooling_contiguous_groups_is_group_norm(groups):
    layer = set_dn_gates(trained(DynamicNorm2d(CHANNELS)), groups=groups, batch=False)
    affine, module = evaluation_form(layer)
    assert affine is None and isinstance(module, GroupNorm2d) and module.num_groups == groups
    x = sample()
    with torch.no_grad():
        torch.testing.assert_close(module(x), nn.functional.group_norm(x, groups, layer.weight, layer.bias, layer.eps))
        torch.testing.assert_close(module(x), layer(x), rtol=1e-5, atol=1e-5)


def test_dn_with_strided_groups_stays_itself():
    layer = set_dn_gates(trained(DynamicNorm2d(CHANNELS)), groups=CHANNELS, batch=False, strided=True)
    assert not layer.selected_grouping().contiguous
    assert evaluation_form(layer) == EvaluationForm(None, layer)


def test_mode_norm_with_one_mode_is_batch_norm():
    layer = trained(ModeNorm2d(CHANNELS, num_modes=1))
    affine, module = evaluation_form(layer)
    assert isinstance(affine, ChannelAffine) and module is None
    batch_norm = nn.BatchNorm2d(CHANNELS).eval()
    with torch.no_grad():
        batch_norm.weight.copy_(layer.weight)
        batch_norm.bias.copy_(layer.bias)
        batch_norm.running_mean.copy_(layer.running_mean[0])
        batch_norm.running_var.copy_(layer.running_var[0])
    x = sample()
    with torch.no_grad():
        torch.testing.assert_close(affine(x), batch_norm(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(affine(x), layer(x), rtol=1e-5, atol=1e-5)


def test_bnsr_is_its_standardization_then_phi_and_its_affine():
    layer = trained(SkewnessReducedBatchNorm2d(CHANNELS, p=1.2))
    affine, module = evaluation_form(layer)
    assert isinstance(affine, ChannelAffine) and isinstance(module, SignedPowerAffine)
    x = sample()
    z = (x - layer.running_mean[:, None, None]) / torch.sqrt(layer.running_var[:, None, None] + layer.eps)
    expected = layer.weight[:, None, None] * torch.sign(z) * z.abs() ** 1.2 + layer.bias[:, None, None]
    with torch.no_grad():
        torch.testing.assert_close(affine(x), z, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(module(affine(x)), expected, rtol=1e-5, atol=1e-5)


def test_torch_batch_norm_is_a_constant_affine_and_other_modules_have_no_form():
    batch_norm = trained(nn.BatchNorm2d(CHANNELS))
    affine, module = evaluation_form(batch_norm)
    x = sample()
    with torch.no_grad():
        torch.testing.assert_close(affine(x), batch_norm(x), rtol=1e-5, atol=1e-5)
    assert module is None
    assert evaluation_form(nn.ReLU()) is None
    assert evaluation_form(nn.BatchNorm2d(CHANNELS, track_running_stats=False)) is None


@pytest.mark.parametrize("bias", [True, False])
def test_an_affine_folded_into_a_convolution_is_the_convolution_then_the_affine(bias):
    torch.manual_seed(0)
    conv = nn.Conv2d(5, CHANNELS, 3, padding=1, bias=bias)
    affine = ChannelAffine(torch.randn(CHANNELS), torch.randn(CHANNELS))
    x = torch.randn(2, 5, 8, 8)
    with torch.no_grad():
        expected = affine(conv(x))
        fold_into_conv(conv, affine)
        torch.testing.assert_close(conv(x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="8-channel affine into a convolution with 32 output channels"):
        fold_into_conv(conv, ChannelAffine(torch.ones(8), torch.zeros(8)))


@pytest.mark.parametrize(
    "branches, kind",
    [((0, 0), "IN"), ((1, 1), "LN"), ((2, 2), "BN"), ((0, 2), None), ((-1, -1), None)],
    ids=["IN", "LN", "BN", "IN-mean-BN-var", "free"],
)
def test_a_fixed_sparse_switchable_layer_is_its_one_normalizer(branches, kind):
    layer = trained(build_norm("SSN", CHANNELS))
    layer.mean_fixed.fill_(branches[0])
    layer.var_fixed.fill_(branches[1])
    affine, module = evaluation_form(layer)
    x = sample()
    expected = {
        "IN": lambda: nn.functional.instance_norm(x, weight=layer.weight, bias=layer.bias, eps=layer.eps),
        "LN": lambda: nn.functional.group_norm(x, 1, layer.weight, layer.bias, layer.eps),
        "BN": lambda: nn.functional.batch_norm(
            x, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, 0.0, layer.eps
        ),
    }
    with torch.no_grad():
        if kind is None:  # the layer with its weights as constants, computing only the branches they use
            assert affine is None and isinstance(module, FrozenSwitchableNorm2d)
            assert module.used_branches() == ([True, False, True] if branches == (0, 2) else [True, True, True])
        elif kind == "BN":
            assert isinstance(affine, ChannelAffine) and module is None
            torch.testing.assert_close(affine(x), expected[kind](), rtol=1e-5, atol=1e-5)
        else:
            assert affine is None and isinstance(module, GroupNorm2d)
            torch.testing.assert_close(module(x), expected[kind](), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(apply_form(EvaluationForm(affine, module), x), layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["SN", "SyncSN"])
def test_switchable_norm_freezes_its_weights_and_keeps_its_kernels_weights(name):
    layer = trained(build_norm(name, CHANNELS))
    _, frozen = evaluation_form(layer)
    assert isinstance(frozen, FrozenSwitchableNorm2d) and frozen.frozen and not frozen.training
    for frozen_weights, weights in zip(frozen.branch_weights(torch.float64), layer.branch_weights(torch.float64)):
        torch.testing.assert_close(frozen_weights, weights, rtol=1e-6, atol=1e-7)
    # the logits the kernels take: their softmax is the frozen weights
    torch.testing.assert_close(torch.softmax(frozen.mean_weight, 0), frozen.frozen_mean_weights)
    frozen.train()
    assert not frozen.training  # frozen parameters: evaluation mode for good (``base``)
    x = sample()
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), layer(x), rtol=1e-5, atol=1e-5)
