"""The base's extension for every layer with running statistics (running.RunningMoments): torch's reset methods,
one error message for an empty batch average, exact weighted and per-mode pooling, state dicts of earlier
versions that still load, and momentum None as BatchNorm's cumulative average (eager and scripted)."""

import copy

import pytest
import torch

from sn_detection.layers import NORM_NAMES, RunningMoments, build_norm
from sn_detection.layers.running import NO_STATISTICS, MomentAccumulator, group_sums, mode_sums, moments_from_sums

WITH_RUNNING_STATISTICS = ["SN", "SyncSN", "SSN", "SyncSSN", "DN", "MN", "BNSR"]


def trained(name, channels=8):
    torch.manual_seed(0)
    layer = build_norm(name, channels).train()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(torch.randn_like(parameter))
        for _ in range(3):
            layer(torch.randn(3, channels, 4, 5) * 2 + 1)
    return layer


def test_the_layers_with_running_statistics_share_the_base():
    owners = [name for name in NORM_NAMES if isinstance(build_norm(name, 32), RunningMoments)]
    assert owners == WITH_RUNNING_STATISTICS


@pytest.mark.parametrize("name", WITH_RUNNING_STATISTICS)
def test_reset_running_stats_and_reset_parameters_are_torchs(name):
    layer = trained(name)
    assert layer.num_batches_tracked == 3
    layer.reset_running_stats()
    assert (layer.running_mean == 0).all() and (layer.running_var == 1).all() and layer.num_batches_tracked == 0
    torch.manual_seed(1)
    fresh = build_norm(name, 8)
    layer = trained(name)
    torch.manual_seed(1)
    layer.reset_parameters()
    for key, value in fresh.state_dict().items():
        if not key.startswith("gate."):  # MN's gate is random: torch's Linear initialisation, drawn again
            assert torch.equal(layer.state_dict()[key], value), key


@pytest.mark.parametrize("name", WITH_RUNNING_STATISTICS)
def test_one_message_for_a_batch_average_without_statistics(name):
    layer = build_norm(name, 8).train()
    layer.start_batch_average()
    layer(torch.zeros(0, 8, 3, 3))
    with pytest.raises(RuntimeError, match=NO_STATISTICS.replace("(", r"\(").replace(")", r"\)")):
        layer.finish_batch_average()
    with pytest.raises(RuntimeError, match=r"finish_batch_average\(\) called without start_batch_average\(\)"):
        layer.finish_batch_average()


def test_weighted_and_per_mode_sums_pool_exactly():
    generator = torch.Generator().manual_seed(0)
    groups = [torch.randn(5, 3, 7, generator=generator) * 3 + 2 for _ in range(2)]  # (G, C, values)
    weights = torch.rand(5, 2, generator=generator, dtype=torch.float64)  # G groups, K modes
    accumulator = MomentAccumulator()
    for values in groups:
        var, mean = torch.var_mean(values, dim=2, correction=0)
        accumulator.add(mode_sums(mean, var, weights * values.shape[2]))
    mean, var = moments_from_sums(accumulator.pooled())
    values = torch.cat(groups).double()  # (2G, C, 7)
    pixel_weights = weights.repeat(2, 1)[:, :, None, None].expand(-1, -1, 3, 7)  # (2G, K, C, 7)
    for k in range(2):
        w = pixel_weights[:, k]
        expected_mean = (w * values).sum((0, 2)) / w.sum((0, 2))
        expected_var = (w * (values - expected_mean[:, None]).square()).sum((0, 2)) / w.sum((0, 2))
        torch.testing.assert_close(mean[k], expected_mean)
        torch.testing.assert_close(var[k], expected_var)


def test_group_sums_of_an_empty_batch_are_no_values():
    sums = group_sums(torch.zeros(0, 4), torch.zeros(0, 4), 9)
    assert sums.count == 0 and moments_from_sums(sums)[0].eq(0).all()


def test_a_dn_state_dict_without_num_batches_tracked_loads():
    layer = trained("DN")
    state = {key: value for key, value in layer.state_dict().items() if key != "num_batches_tracked"}
    loaded = build_norm("DN", 8)
    loaded.load_state_dict(state)  # strict
    assert loaded.num_batches_tracked == 0 and torch.equal(loaded.running_var, layer.running_var)


def test_an_mn_state_dict_with_the_former_second_moment_loads_as_its_variance():
    layer = trained("MN")
    state = {
        key: value for key, value in layer.state_dict().items() if key not in ("running_var", "num_batches_tracked")
    }
    state["running_sq_mean"] = layer.running_var + layer.running_mean.square()
    loaded = build_norm("MN", 8)
    loaded.load_state_dict(state)
    torch.testing.assert_close(loaded.running_var, layer.running_var)


def test_a_state_dict_of_this_version_must_be_complete():
    layer = trained("DN")
    state = layer.state_dict()
    del state["num_batches_tracked"]
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        build_norm("DN", 8).load_state_dict(state)


def batch_norms_cumulative_average(batches, channels):
    """torch's BatchNorm2d(momentum=None) after ``batches``: the oracle of the cumulative average."""
    bn = torch.nn.BatchNorm2d(channels, momentum=None).double().train()
    for x in batches:
        bn(x.double())
    return bn


@pytest.mark.parametrize("name", WITH_RUNNING_STATISTICS)
def test_momentum_none_is_batch_norms_cumulative_average(name):
    channels, generator = 8, torch.Generator().manual_seed(0)
    # one batch size, so that the average of biased variances is the unbiased one's times (count - 1) / count
    batches = [torch.randn(3, channels, 4, 5, generator=generator) * (1 + k) + k for k in range(4)]
    options = {"num_modes": 1} if name == "MN" else {}  # one mode is BN
    layer = build_norm(name, channels, momentum=None, **options).train()
    with torch.no_grad():
        for x in batches:
            layer(x)
    bn = batch_norms_cumulative_average(batches, channels)
    count = 3 * 4 * 5
    if name == "BNSR":  # BatchNorm's unbiased variance
        expected_var = bn.running_var
    elif name == "MN":  # the variance of the mixture of every batch seen, equally weighted: of their concatenation
        expected_var = torch.cat(batches).double().var((0, 2, 3), unbiased=False)
    else:
        expected_var = bn.running_var * (count - 1) / count
    assert layer.num_batches_tracked == bn.num_batches_tracked == len(batches)
    torch.testing.assert_close(layer.running_mean.double().view(-1), bn.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.running_var.double().view(-1), expected_var, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", WITH_RUNNING_STATISTICS)
def test_momentum_must_be_a_fraction_or_none(name):
    assert build_norm(name, 8, momentum=None).momentum is None
    with pytest.raises(ValueError, match=r"momentum=1\.5 is invalid: it must be a number in \[0, 1\].*or None"):
        build_norm(name, 8, momentum=1.5)


@pytest.mark.parametrize("name", ["SN", "DN", "MN", "BNSR"])
def test_a_scripted_layer_keeps_the_cumulative_average(name):
    eager = build_norm(name, 8, momentum=None).train()
    scripted = torch.jit.script(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(0)
    for k in range(3):
        x = torch.randn(2, 8, 3, 3, generator=generator) + k
        with torch.no_grad():
            eager(x)
            scripted(x)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(scripted, key), getattr(eager, key), msg=key)
