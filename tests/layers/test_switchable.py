"""SwitchableNorm2d against Eq. 2-4 of the SN paper, computed naively from each statistic's pixel set."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from sn_detection.layers import SwitchableNorm2d
from sn_detection.layers.switchable_kernels import SwitchableClosedForms

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
ONE_HOT = 1e4  # softmax([1e4, 0, 0]) is exactly [1, 0, 0] in fp32 and fp64


def naive_moments(pixels):
    """Eq. 2: mean and (biased) variance of a set of pixels."""
    mean = pixels.sum() / pixels.numel()
    return mean, ((pixels - mean) ** 2).sum() / pixels.numel()


def naive_switchable_norm(x, mean_logits, var_logits, weight, bias, eps, bn_statistics=None):
    """Eq. 3 with Eq. 4 weights, each of IN / LN / BN statistics computed from its own pixel set.

    ``bn_statistics``: (mean, var) per channel to use for the BN branch (test time), else the batch's.
    Two logits mean no BN branch.
    """
    mean_w = torch.exp(mean_logits) / torch.exp(mean_logits).sum()
    var_w = torch.exp(var_logits) / torch.exp(var_logits).sum()
    out = torch.empty_like(x)
    for n in range(x.shape[0]):
        mean_ln, var_ln = naive_moments(x[n])
        for c in range(x.shape[1]):
            mean_in, var_in = naive_moments(x[n, c])
            if bn_statistics is None:
                mean_bn, var_bn = naive_moments(x[:, c])
            else:
                mean_bn, var_bn = bn_statistics[0][c], bn_statistics[1][c]
            means, variances = [mean_in, mean_ln, mean_bn], [var_in, var_ln, var_bn]
            mean = sum(w * m for w, m in zip(mean_w, means))
            var = sum(w * v for w, v in zip(var_w, variances))
            out[n, c] = weight[c] * (x[n, c] - mean) / torch.sqrt(var + eps) + bias[c]
    return out


def random_layer(num_channels, dtype, use_bn=True, seed=0):
    """An SN layer with random affine and logits, so that every term of Eq. 3 matters."""
    generator = torch.Generator().manual_seed(seed)
    layer = SwitchableNorm2d(num_channels, use_bn=use_bn).to(dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=dtype))
    return layer


def random_input(shape, dtype, seed=1):
    generator = torch.Generator().manual_seed(seed)
    # an offset per channel so that means are not all ~0 and the variances differ per scope
    offset = torch.randn(shape[1], 1, 1, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator, dtype=dtype) * 2 + offset


def naive_output(layer, x, bn_statistics=None):
    return naive_switchable_norm(
        x, layer.mean_weight, layer.var_weight, layer.weight, layer.bias, layer.eps, bn_statistics
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("use_bn", [True, False])
def test_training_matches_equation(dtype, use_bn):
    layer = random_layer(5, dtype, use_bn)
    x = random_input((3, 5, 4, 6), dtype)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), naive_output(layer, x), rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_evaluation_takes_only_bn_branch_from_running_statistics(dtype):
    layer = random_layer(5, dtype)
    with torch.no_grad():
        for seed in range(3):
            layer(random_input((4, 5, 3, 3), dtype, seed=seed))
        layer.eval()
        x = random_input((2, 5, 4, 6), dtype, seed=7)
        expected = naive_output(layer, x, (layer.running_mean, layer.running_var))
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=TOLERANCE[dtype])


def test_running_statistics_follow_pytorch_momentum_with_biased_variance():
    layer = SwitchableNorm2d(3, momentum=0.3).double()
    batches = [random_input((2, 3, 4, 4), torch.float64, seed=seed) for seed in range(2)]
    expected_mean, expected_var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for x in batches:
        layer(x)
        batch = [naive_moments(x[:, c]) for c in range(3)]
        expected_mean = 0.7 * expected_mean + 0.3 * torch.stack([m for m, _ in batch])
        expected_var = 0.7 * expected_var + 0.3 * torch.stack([v for _, v in batch])
    torch.testing.assert_close(layer.running_mean, expected_mean)
    torch.testing.assert_close(layer.running_var, expected_var)
    assert layer.num_batches_tracked.item() == 2


def test_without_bn_branch_has_no_buffers_and_ignores_mode():
    layer = random_layer(4, torch.float64, use_bn=False)
    assert layer.mean_weight.shape == layer.var_weight.shape == (2,)
    assert dict(layer.named_buffers()) == {}
    x = random_input((3, 4, 5, 5), torch.float64)
    train_output = layer(x)
    # the same equations; training takes the closed forms, evaluation the layer's scale_and_shift: float64
    # rounding apart
    torch.testing.assert_close(layer.eval()(x), train_output, rtol=1e-13, atol=1e-13)
    layer.start_batch_average()
    layer.finish_batch_average()  # nothing to average: a no-op, not an error


def one_hot_layer(branch, num_channels, dtype=torch.float64):
    """SN whose mean and variance weights are both one-hot on ``branch`` (0 = IN, 1 = LN, 2 = BN)."""
    layer = random_layer(num_channels, dtype)
    with torch.no_grad():
        logits = torch.zeros(3, dtype=dtype)
        logits[branch] = ONE_HOT
        layer.mean_weight.copy_(logits)
        layer.var_weight.copy_(logits)
    return layer


@pytest.mark.parametrize(
    "branch, reference",
    [
        (0, lambda x, w, b: F.instance_norm(x, weight=w, bias=b)),
        (1, lambda x, w, b: F.group_norm(x, 1, w, b)),
        (2, lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)),
    ],
    ids=["IN", "LN", "BN"],
)
def test_one_hot_weights_reduce_to_torch_norm(branch, reference):
    layer = one_hot_layer(branch, 6)
    x = random_input((3, 6, 5, 4), torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(x, layer.weight, layer.bias), rtol=0, atol=1e-6)


def test_one_hot_bn_in_evaluation_is_batch_norm_with_running_statistics():
    layer = one_hot_layer(2, 6)
    with torch.no_grad():
        layer(random_input((4, 6, 3, 3), torch.float64, seed=3))
        layer.eval()
        x = random_input((2, 6, 5, 4), torch.float64)
        expected = F.batch_norm(x, layer.running_mean, layer.running_var, layer.weight, layer.bias, False)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("use_bn", [True, False])
def test_gradients_including_logits(training, use_bn):
    layer = random_layer(4, torch.float64, use_bn).train(training)
    if use_bn:
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
    names = [name for name, _ in layer.named_parameters()]
    assert set(names) == {"weight", "bias", "mean_weight", "var_weight"}

    def output(x, *parameters):
        return functional_call(layer, dict(zip(names, parameters)), (x,))

    x = random_input((3, 4, 3, 3), torch.float64).requires_grad_()
    parameters = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    assert torch.autograd.gradcheck(output, (x, *parameters))


def test_tensors_off_the_kernel_path_take_the_closed_forms(monkeypatch):
    # float64 never takes the Triton kernels: its gradients come from the closed forms as tensor operations,
    # whose values test_gradients_including_logits checks with gradcheck
    backwards = []
    original = SwitchableClosedForms.backward
    monkeypatch.setattr(
        SwitchableClosedForms, "backward", lambda self, *args: backwards.append(self) or original(self, *args)
    )
    layer = random_layer(4, torch.float64, True)
    layer(random_input((3, 4, 3, 3), torch.float64).requires_grad_()).sum().backward()
    assert len(backwards) == 1


def concatenated_moments(batches):
    everything = torch.cat(batches)
    return everything.mean((0, 2, 3)), everything.var((0, 2, 3), unbiased=False)


def test_batch_average_equals_statistics_of_concatenation():
    layer = SwitchableNorm2d(3).double()
    batches = [random_input((n, 3, 4, 5), torch.float64, seed=n) * n for n in (1, 4, 2)]
    layer.start_batch_average()
    for x in batches:
        layer(x)
    # pooling replaces the moving average: buffers untouched until finish
    assert layer.running_mean.eq(0).all() and layer.running_var.eq(1).all()
    assert layer.num_batches_tracked.item() == 0
    layer.finish_batch_average()
    mean, var = concatenated_moments(batches)
    torch.testing.assert_close(layer.running_mean, mean)
    torch.testing.assert_close(layer.running_var, var)
    layer(batches[0])  # after finish, the moving average resumes
    assert layer.num_batches_tracked.item() == 1


def test_batch_average_ignores_evaluation_forwards():
    layer = SwitchableNorm2d(3).double()
    batches = [random_input((2, 3, 4, 4), torch.float64, seed=seed) for seed in range(2)]
    layer.start_batch_average()
    layer(batches[0])
    layer.eval()(batches[1])
    layer.finish_batch_average()
    mean, var = concatenated_moments(batches[:1])
    torch.testing.assert_close(layer.running_mean, mean)
    torch.testing.assert_close(layer.running_var, var)


def test_finishing_batch_average_without_batches_is_an_error():
    layer = SwitchableNorm2d(3)
    with pytest.raises(RuntimeError, match="without start_batch_average"):
        layer.finish_batch_average()
    layer.start_batch_average()
    layer(torch.randn(0, 3, 4, 4))
    with pytest.raises(RuntimeError, match="no statistics"):
        layer.finish_batch_average()
