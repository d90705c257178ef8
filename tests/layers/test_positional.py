"""PositionalNorm2d and the moment shortcut against the PONO equations, position by position."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from sn_detection.layers import PositionalNorm2d, moment_shortcut, pono

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def naive_pono(x, eps):
    """mu, sigma over the channels of each (n, h, w); returns (x - mu) / sigma, mu, sigma."""
    normalized = torch.empty_like(x)
    mean = x.new_empty(x.shape[0], 1, *x.shape[2:])
    std = torch.empty_like(mean)
    for n in range(x.shape[0]):
        for h in range(x.shape[2]):
            for w in range(x.shape[3]):
                values = x[n, :, h, w]
                mu = values.sum() / values.numel()
                sigma = torch.sqrt(((values - mu) ** 2).sum() / values.numel() + eps)
                normalized[n, :, h, w] = (values - mu) / sigma
                mean[n, 0, h, w], std[n, 0, h, w] = mu, sigma
    return normalized, mean, std


def random_layer(num_channels, dtype):
    layer = PositionalNorm2d(num_channels).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    return layer


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pono_matches_equation(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 4, dtype=dtype) * 2 + 1
    for got, expected in zip(pono(x, 1e-5), naive_pono(x, 1e-5)):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_layer_is_pono_then_channel_affine(dtype, training):
    torch.manual_seed(0)
    layer = random_layer(5, dtype).train(training)
    x = torch.randn(2, 5, 3, 4, dtype=dtype) * 2 + 1
    normalized, _, _ = naive_pono(x, layer.eps)
    expected = normalized * layer.weight[:, None, None] + layer.bias[:, None, None]
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=TOLERANCE[dtype])


def test_layer_equals_layer_norm_over_channels_at_each_position():
    torch.manual_seed(0)
    layer = random_layer(6, torch.float32)
    x = torch.randn(2, 6, 3, 4)
    expected = F.layer_norm(x.permute(0, 2, 3, 1), (6,), layer.weight, layer.bias, layer.eps).permute(0, 3, 1, 2)
    torch.testing.assert_close(layer(x), expected)


def test_moment_shortcut_reinjects_the_moments():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64) * 3 + 2
    normalized, mean, std = pono(x, eps=0.0)
    torch.testing.assert_close(moment_shortcut(normalized, mean, std), x)


def test_layer_has_no_buffers():
    assert dict(PositionalNorm2d(4).named_buffers()) == {}


def test_gradients():
    torch.manual_seed(0)
    layer = random_layer(4, torch.float64)
    names = [name for name, _ in layer.named_parameters()]
    assert names == ["weight", "bias"]

    def output(x, *parameters):
        return functional_call(layer, dict(zip(names, parameters)), (x,))

    x = torch.randn(3, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    parameters = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    assert torch.autograd.gradcheck(output, (x, *parameters))


@pytest.mark.parametrize(
    "shape,channels_last",
    [((2, 6, 3, 4), False), ((2, 6, 3, 4), True), ((3, 1, 2, 2), False), ((2, 5, 1, 1), False), ((0, 4, 2, 2), False)],
    ids=["nchw", "channels_last", "one_channel", "1x1", "empty"],
)
def test_gradient_free_pass_equals_the_equations(shape, channels_last):
    """Without gradients the layer normalizes through BatchNorm's kernel over each sample's (C, H * W) view;
    the positions' statistics are still the equations', whatever the layout, one channel or none."""
    torch.manual_seed(0)
    layer = random_layer(shape[1], torch.float64).eval()
    x = torch.randn(shape, dtype=torch.float64) * 2 + 1
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    normalized, _, _ = naive_pono(x, layer.eps)
    expected = normalized * layer.weight[:, None, None] + layer.bias[:, None, None]
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-10)
