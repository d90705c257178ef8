"""The contract every layer of ``build_norm`` honours, whatever its equation.

Detection feeds norms empty batches (no proposals), single images, 1x1 maps, mixed precision and
channels-last tensors, and saves and reloads them; each case below is run for every registered name.
"""

import copy
import re
import warnings

import pytest
import torch
from low_precision import assert_float32_computation_rounded_once

from sn_detection.layers import NORM_NAMES, build_norm, norm_options, update_batch_average

CHANNELS = 8


def make(name, seed=0):
    """A layer with perturbed parameters, so that round trips and comparisons are not trivial."""
    options = {"num_groups": 4} if "num_groups" in norm_options(name) else {}
    torch.manual_seed(seed)
    layer = build_norm(name, CHANNELS, **options)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return layer


def features(n, size=5, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, CHANNELS, size, size + 1, generator=generator) * 2 + 0.5


def buffers(layer):
    return {name: buffer.clone() for name, buffer in layer.named_buffers()}


def assert_same_buffers(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.fixture(params=NORM_NAMES)
def name(request):
    return request.param


@pytest.mark.parametrize("num_channels", [0, -3, 2.5, "8", True])
def test_a_channel_count_that_is_no_positive_int_is_refused(name, num_channels):
    with pytest.raises(ValueError, match=rf"num_channels must be a positive int, got {re.escape(repr(num_channels))}"):
        build_norm(name, num_channels)


@pytest.mark.parametrize("shape", [(2, CHANNELS), (2, CHANNELS, 5), (2, CHANNELS, 3, 4, 5), (2, CHANNELS - 1, 5, 6)])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_input_of_another_shape_is_refused(name, shape, training):
    expected = rf"expected input of shape \(N, {CHANNELS}, H, W\), got {re.escape(str(list(shape)))}"
    with pytest.raises(ValueError, match=expected):
        make(name).train(training)(torch.randn(shape))


def test_integer_input_is_refused(name):
    with pytest.raises(TypeError, match="expected floating-point input, got torch.int64"):
        make(name)(torch.ones(2, CHANNELS, 5, 6, dtype=torch.long))


def test_weight_and_bias_per_channel(name):
    parameters = dict(make(name).named_parameters())
    assert parameters["weight"].shape == parameters["bias"].shape == (CHANNELS,)


def test_empty_batch_gives_empty_output_and_keeps_buffers(name):
    layer = make(name).train()
    before = buffers(layer)
    x = features(0).requires_grad_()
    y = layer(x)
    assert y.shape == x.shape and y.isfinite().all()
    assert_same_buffers(buffers(layer), before)
    y.sum().backward()
    assert all(p.grad is None or p.grad.isfinite().all() for p in layer.parameters())


def test_a_double_backward_of_an_empty_batch_warns_of_nothing(name):
    """A gradient penalty on an image without proposals: no degrees-of-freedom warning from var_mean."""
    layer = make(name).train()
    x = features(0).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (grad,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        grad.sum().backward()


def test_single_sample_in_training(name):
    assert make(name).train()(features(1)).isfinite().all()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_one_by_one_maps(name, n, training):
    x = features(n)[:, :, :1, :1]
    assert make(name).train(training)(x).isfinite().all()


@pytest.mark.parametrize("averaging", [False, True], ids=["moving_average", "batch_average"])
def test_batches_of_one_value_per_channel_move_the_mean_but_not_the_variance(name, averaging):
    """One image of 1x1 maps has no spread: its variance of 0 would pull the running variance towards 0,
    until evaluation divides by sqrt(eps) (torch's BatchNorm refuses such a batch)."""
    layer = make(name).train()
    if "running_var" not in dict(layer.named_buffers()) or name == "MN":
        pytest.skip(f"{name} keeps no average of batch variances (MN: the variance of the mixture, Alg. 2)")
    before = buffers(layer)
    batches = [features(1, seed=seed)[:, :, :1, :1] * 3 + 5 for seed in range(20)]
    if averaging:  # of one such batch (twenty would pool twenty values, which have a spread)
        update_batch_average(layer, iter(batches), num_batches=1)
    else:
        for x in batches:
            layer(x)
    assert torch.equal(layer.running_var, before["running_var"])
    assert not torch.equal(layer.running_mean, before["running_mean"])
    assert layer.eval()(batches[0]).abs().max() < 20


def test_switching_between_training_and_evaluation(name):
    layer = make(name).train()
    assert layer(features(3, seed=2)).isfinite().all()
    layer.eval()
    after_training = buffers(layer)
    first = layer(features(2, seed=3))
    torch.testing.assert_close(layer(features(2, seed=3)), first, rtol=0, atol=0)
    assert_same_buffers(buffers(layer), after_training)
    assert layer.train()(features(3, seed=4)).isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16_autocast"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_low_precision_output_is_the_float32_computation_rounded_once(name, training, dtype):
    assert_float32_computation_rounded_once(make(name).train(training), features(2), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_layer_converted_to_low_precision_still_computes_in_float32(name, training, dtype):
    """``model.half()`` rounds parameters and buffers too: the output is the float32 computation with those
    rounded values, rounded once, and the backward gives gradients in the parameters' dtype."""
    layer = make(name).train()
    layer(features(3, seed=4))  # running statistics that are not the initial ones
    low = layer.train(training).to(dtype)
    x = features(2).to(dtype).requires_grad_()
    expected = copy.deepcopy(low).float()(x.detach().float())
    y = low(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), expected, rtol=torch.finfo(dtype).eps, atol=1e-6)
    (y.float() * features(2, seed=5)).sum().backward()
    assert x.grad.isfinite().all()
    for parameter_name, parameter in low.named_parameters():
        assert parameter.grad.dtype == dtype and parameter.grad.isfinite().all(), parameter_name


def test_channels_last_gives_the_same_values(name):
    contiguous, channels_last = make(name).train(), make(name).train()
    x = features(3)
    expected = contiguous(x)
    got = channels_last(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for (key, value), other in zip(contiguous.state_dict().items(), channels_last.state_dict().values()):
        torch.testing.assert_close(other, value, rtol=1e-5, atol=1e-5, msg=key)


def test_state_dict_round_trip(name):
    layer = make(name).train()
    for seed in range(2):
        layer(features(3, seed=seed))
    fresh = make(name, seed=1)
    fresh.load_state_dict(layer.state_dict())
    assert_same_buffers(buffers(fresh), buffers(layer))
    layer.eval()
    fresh.eval()
    torch.testing.assert_close(fresh(features(2, seed=9)), layer(features(2, seed=9)), rtol=0, atol=0)


def test_backward_gives_finite_gradients(name):
    layer = make(name).train()
    x = features(3).requires_grad_()
    (layer(x) * features(3, seed=5)).sum().backward()
    assert x.grad.isfinite().all()
    for parameter_name, parameter in layer.named_parameters():
        assert parameter.grad is not None and parameter.grad.isfinite().all(), parameter_name


def test_failed_batch_average_returns_to_the_moving_average(name):
    """finish_batch_average() with no batch seen raises, and the layer is not left averaging."""
    layer = make(name).train()
    if not hasattr(layer, "start_batch_average") or not list(layer.buffers()):
        pytest.skip(f"{name} has no batch-dependent test statistics")
    layer.start_batch_average()
    with pytest.raises(RuntimeError, match="batch"):
        layer.finish_batch_average()
    before = buffers(layer)
    layer(features(2))
    changed = [key for key, value in buffers(layer).items() if not torch.equal(value, before[key])]
    assert changed, "a training forward after the failed finish should update the moving average"


# Inputs that break statistics computed in the input's precision: constant channels (variance 0, so
# 1 / sqrt(var + eps) is as large as it gets) and fp16 values near its maximum 65504, whose squares
# overflow fp16 (the layers compute statistics in float32, see statistics.stat_dtype).
EXTREME_INPUTS = {
    "zeros": lambda g: torch.zeros(2, CHANNELS, 5, 6),
    "constant -3.5": lambda g: torch.full((2, CHANNELS, 5, 6), -3.5),
    "constant 6e4": lambda g: torch.full((2, CHANNELS, 5, 6), 6e4),
    "uniform in +-6e4": lambda g: (torch.rand(2, CHANNELS, 5, 6, generator=g) * 2 - 1) * 6e4,
    "uniform in [3e4, 6e4]": lambda g: (torch.rand(2, CHANNELS, 5, 6, generator=g) + 1) * 3e4,
}
LOW_PRECISION = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def extreme_input(kind, dtype, n):
    return EXTREME_INPUTS[kind](torch.Generator().manual_seed(3))[:n].to(dtype)


def average_over(layer, x):
    """The layer's test statistics set to those of x (for layers that have them): in evaluation mode
    the output is then normalized as in training, not x scaled by default statistics (mean 0, var 1),
    which for x near 6e4 is legitimately beyond fp16's range."""
    if hasattr(layer, "start_batch_average") and list(layer.buffers()):
        layer.start_batch_average()
        with torch.no_grad():
            layer(x)
        layer.finish_batch_average()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", LOW_PRECISION.values(), ids=LOW_PRECISION.keys())
@pytest.mark.parametrize("kind", EXTREME_INPUTS)
def test_extreme_low_precision_inputs_give_finite_outputs_and_gradients(name, kind, dtype, n):
    x = extreme_input(kind, dtype, n).requires_grad_()
    layer = make(name).train()
    y = layer(x)
    assert y.dtype == dtype and y.isfinite().all(), "training output"
    (y.float() * features(n, seed=6)[:, :, :5, :6]).sum().backward()
    assert x.grad.isfinite().all(), "input gradient"
    for parameter_name, parameter in layer.named_parameters():
        assert parameter.grad is None or parameter.grad.isfinite().all(), parameter_name

    average_over(layer, x.detach())
    y = layer.eval()(x.detach())
    assert y.dtype == dtype and y.isfinite().all(), "evaluation output"


@pytest.mark.parametrize("dtype", LOW_PRECISION.values(), ids=LOW_PRECISION.keys())
@pytest.mark.parametrize("kind", ["zeros", "constant -3.5"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_constant_channels_normalize_to_the_bias(name, kind, dtype, training):
    x = extreme_input(kind, dtype, 2)
    layer = make(name)
    average_over(layer, x)
    y = layer.train(training)(x)
    expected = layer.bias.detach()[:, None, None].expand(x.shape)
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=1e-2)
