"""GroupNorm2d against the GN equation computed group by group, and against torch.nn.GroupNorm."""

import pytest
import torch
from layer_state import tensors
from torch.func import functional_call

from sn_detection.layers import GroupNorm2d

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def naive_group_norm(x, num_groups, weight, bias, eps):
    """y = gamma (x - mu_g) / sqrt(var_g + eps) + beta, moments over each group's channels and pixels."""
    out = torch.empty_like(x)
    size = x.shape[1] // num_groups
    for n in range(x.shape[0]):
        for g in range(num_groups):
            channels = slice(g * size, (g + 1) * size)
            pixels = x[n, channels]
            mean = pixels.sum() / pixels.numel()
            var = ((pixels - mean) ** 2).sum() / pixels.numel()
            for c in range(channels.start, channels.stop):
                out[n, c] = weight[c] * (x[n, c] - mean) / torch.sqrt(var + eps) + bias[c]
    return out


def random_layer(num_channels, num_groups, dtype):
    layer = GroupNorm2d(num_channels, num_groups=num_groups).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    return layer


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_matches_equation(dtype, training):
    torch.manual_seed(0)
    layer = random_layer(6, 3, dtype).train(training)
    x = torch.randn(2, 6, 4, 5, dtype=dtype) * 3 + 1
    with torch.no_grad():
        expected = naive_group_norm(x, 3, layer.weight, layer.bias, layer.eps)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=TOLERANCE[dtype])


def test_equals_torch_group_norm_with_detectron2_default_of_32_groups():
    torch.manual_seed(0)
    layer = random_layer(64, 32, torch.float32)
    assert GroupNorm2d(64).num_groups == 32
    reference = torch.nn.GroupNorm(32, 64)
    reference.load_state_dict(tensors(layer))
    x = torch.randn(2, 64, 5, 3)
    torch.testing.assert_close(layer(x), reference(x))


def test_indivisible_channels_name_both_numbers():
    with pytest.raises(ValueError, match=r"num_channels=48 .* num_groups=32"):
        GroupNorm2d(48)


def test_gradients():
    torch.manual_seed(0)
    layer = random_layer(4, 2, torch.float64)
    names = [name for name, _ in layer.named_parameters()]
    assert names == ["weight", "bias"]

    def output(x, *parameters):
        return functional_call(layer, dict(zip(names, parameters)), (x,))

    x = torch.randn(3, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    parameters = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    # fast mode: torch's multithreaded group_norm kernel is slow to launch for the many tiny calls of full mode
    assert torch.autograd.gradcheck(output, (x, *parameters), fast_mode=True)
