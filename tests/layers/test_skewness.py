"""SkewnessReducedBatchNorm2d against Alg. 1 / 2 of the BNSR paper, channel by channel."""

import pytest
import torch
from layer_state import tensors
from torch.func import functional_call

from sn_detection.layers import SkewnessReducedBatchNorm2d
from sn_detection.layers.skewness import signed_power

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def phi(z, p):
    """Eq. 6: z^p for z >= 0, -(-z)^p for z < 0."""
    return torch.where(z >= 0, z.clamp(min=0) ** p, -((-z).clamp(min=0) ** p))


def naive_bnsr(x, p, weight, bias, eps, statistics=None):
    """Alg. 1 (batch mean and biased variance per channel) or Alg. 2 (given ``statistics``)."""
    out = torch.empty_like(x)
    for c in range(x.shape[1]):
        values = x[:, c]
        if statistics is None:
            mean = values.sum() / values.numel()
            var = ((values - mean) ** 2).sum() / values.numel()
        else:
            mean, var = statistics[0][c], statistics[1][c]
        out[:, c] = weight[c] * phi((values - mean) / torch.sqrt(var + eps), p) + bias[c]
    return out


def random_layer(num_channels, dtype, p=1.01, momentum=0.1):
    layer = SkewnessReducedBatchNorm2d(num_channels, p=p, momentum=momentum).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    return layer


def skewed_input(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=dtype).exp() * 2 - 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p", [1.01, 1.5, 0.7])
def test_training_and_evaluation_match_algorithms(dtype, p):
    torch.manual_seed(0)
    layer = random_layer(4, dtype, p=p)
    x = skewed_input((3, 4, 5, 4), dtype)
    with torch.no_grad():
        expected = naive_bnsr(x, p, layer.weight, layer.bias, layer.eps)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=TOLERANCE[dtype])
        layer.eval()
        statistics = (layer.running_mean, layer.running_var)
        expected = naive_bnsr(x, p, layer.weight, layer.bias, layer.eps, statistics)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=TOLERANCE[dtype])


def test_running_statistics_use_unbiased_variance_like_batch_norm():
    layer = random_layer(3, torch.float64, momentum=0.25)
    x = skewed_input((2, 3, 4, 4), torch.float64)
    layer(x)
    values = x.transpose(0, 1).reshape(3, -1)
    expected_var = 0.75 + 0.25 * ((values - values.mean(1, keepdim=True)) ** 2).sum(1) / (values.shape[1] - 1)
    torch.testing.assert_close(layer.running_mean, 0.25 * values.mean(1))
    torch.testing.assert_close(layer.running_var, expected_var)
    assert layer.num_batches_tracked.item() == 1


def test_p_one_is_batch_norm_in_training_and_evaluation():
    torch.manual_seed(0)
    layer = random_layer(4, torch.float32, p=1.0)
    reference = torch.nn.BatchNorm2d(4)
    reference.load_state_dict(tensors(layer))
    for seed in range(3):
        x = skewed_input((3, 4, 5, 5), torch.float32, seed)
        torch.testing.assert_close(layer(x), reference(x))
    torch.testing.assert_close(tensors(layer), reference.state_dict())
    layer.eval()
    reference.eval()
    torch.testing.assert_close(layer(x), reference(x))


def test_signed_power_values_and_finite_gradient_at_zero():
    z = torch.tensor([-8.0, -1.0, 0.0, 1.0, 8.0], requires_grad=True)
    torch.testing.assert_close(signed_power(z, 1 / 3), torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0]))
    for p, slope_at_zero in [(1.01, 0.0), (2.0, 0.0), (1.0, 1.0), (0.5, 0.0)]:
        (grad,) = torch.autograd.grad(signed_power(z, p).sum(), z)
        assert grad[2].item() == slope_at_zero
        torch.testing.assert_close(grad[[0, 1, 3, 4]], p * z.detach()[[0, 1, 3, 4]].abs() ** (p - 1))


def test_constant_channel_gives_finite_gradients():
    layer = random_layer(2, torch.float32)
    x = torch.randn(3, 2, 4, 4)
    x[:, 1] = 5.0  # standardizes to exactly 0, where phi_p' is not finite for p < 1
    x.requires_grad_()
    layer(x).square().sum().backward()
    assert all(t.grad.isfinite().all() for t in (x, layer.weight, layer.bias))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gradients(training):
    torch.manual_seed(0)
    layer = random_layer(4, torch.float64).train(training)
    layer.running_mean.uniform_(-1, 1)
    layer.running_var.uniform_(0.5, 2)
    names = [name for name, _ in layer.named_parameters()]
    assert names == ["weight", "bias"]

    def output(x, *parameters):
        return functional_call(layer, dict(zip(names, parameters)), (x,))

    x = skewed_input((3, 4, 3, 3), torch.float64).requires_grad_()
    parameters = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    assert torch.autograd.gradcheck(output, (x, *parameters))


@pytest.mark.parametrize("p", [0.0, -1.0])
def test_non_positive_p_is_rejected(p):
    with pytest.raises(ValueError, match=r"p=-?[0-9.]+ is invalid: it must be a number > 0"):
        SkewnessReducedBatchNorm2d(4, p=p)


def test_batch_average_is_what_batch_norm_stores_for_the_concatenation():
    layer = random_layer(3, torch.float64)
    batches = [skewed_input((n, 3, 4, 3), torch.float64, seed=n) * n for n in (1, 3, 2)]
    layer.start_batch_average()
    for x in batches:
        layer(x)
    layer.finish_batch_average()
    reference = torch.nn.BatchNorm2d(3, momentum=1.0).double()
    reference(torch.cat(batches))
    torch.testing.assert_close(layer.running_mean, reference.running_mean)
    torch.testing.assert_close(layer.running_var, reference.running_var)
    with pytest.raises(RuntimeError, match="without start_batch_average"):
        layer.finish_batch_average()
