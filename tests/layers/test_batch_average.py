"""The batch average (SN paper, Sec. 2.1) of a whole model, ``update_batch_average``: after it, each layer's
test statistics are those of the concatenation of the training batches it saw, computed here naively
from the layer inputs."""

import copy
import logging

import pytest
import torch
from batch_average_nets import (
    NORMS,
    TwoNormNet,
    Untouchable,
    assert_close,
    assert_statistics,
    expected_statistics,
    layer_inputs,
    make_batches,
    parameters,
    pixels,
)
from gloo_processes import run_processes
from torch import nn

from sn_detection.layers import (
    DynamicNorm2d,
    GroupNorm2d,
    SwitchableNorm2d,
    SyncSwitchableNorm2d,
    update_batch_average,
)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_statistics_are_those_of_the_concatenated_batches(norm):
    model = TwoNormNet(norm)
    batches = make_batches()
    inputs = layer_inputs(model, batches)
    before = parameters(model)
    tracked = {name: b.clone() for name, b in model.named_buffers() if name.endswith("num_batches_tracked")}

    used = update_batch_average(model, iter(batches + make_batches(seed=2)), num_batches=3)

    assert used == 3
    for layer, layer_input in zip(model.norms(), inputs):
        assert_statistics(layer, expected_statistics(layer, layer_input))
    for name, value in parameters(model).items():
        assert torch.equal(value, before[name]), name
    for name, value in tracked.items():
        assert torch.equal(dict(model.named_buffers())[name], value), name


@pytest.mark.parametrize("norm", ["SN", "BN", "DN"])
def test_the_layers_return_to_moving_averages_afterwards(norm):
    model = TwoNormNet(norm)
    update_batch_average(model, iter(make_batches()), num_batches=2)
    averaged = model.norm1.running_mean.clone()
    with torch.no_grad():
        model.train()(make_batches(seed=3)[0])
    assert not torch.equal(model.norm1.running_mean, averaged)
    if norm == "BN":
        assert model.norm1.momentum == 0.1


def test_training_flags_are_restored():
    model = TwoNormNet("SN").eval()
    update_batch_average(model, iter(make_batches()), num_batches=1)
    assert not any(m.training for m in model.modules())

    model.train()
    model.conv2.eval()
    update_batch_average(model, iter(make_batches()), num_batches=1)
    assert model.training and model.norm1.training and model.norm2.training
    assert not model.conv2.training


def test_a_model_in_eval_mode_is_averaged_in_training_mode():
    model = TwoNormNet("SN").eval()
    batches = make_batches()[:2]
    inputs = layer_inputs(model, batches)
    update_batch_average(model, iter(batches), num_batches=2)
    assert_statistics(model.norm2, expected_statistics(model.norm2, inputs[1]))


@pytest.mark.parametrize("norm, excluded", [("SN", "frozen"), ("SN", "eval"), ("BN", "eval")])
def test_frozen_and_eval_mode_layers_are_left_alone(norm, excluded):
    model = TwoNormNet(norm)
    if excluded == "frozen":
        model.norm1.freeze()
        model.train()
    else:  # a layer its owner put in evaluation mode within a training model
        model.train()
        model.norm1.eval()
    state = copy.deepcopy(model.norm1.state_dict())
    update_batch_average(model, iter(make_batches()), num_batches=2)
    for name, value in model.norm1.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert not model.norm1.training
    assert not torch.equal(model.norm2.running_mean, torch.zeros(8))


def test_no_op_without_batch_statistics():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), GroupNorm2d(8, num_groups=4), SwitchableNorm2d(8, use_bn=False))
    state = copy.deepcopy(model.state_dict())
    assert update_batch_average(model, Untouchable(), num_batches=5) == 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name])


class Branches(nn.Module):
    """A layer that no input reaches keeps its statistics (and is not left in averaging mode)."""

    def __init__(self):
        super().__init__()
        self.used = SwitchableNorm2d(3)
        self.unused = DynamicNorm2d(4, init_batch_pool=True)

    def forward(self, x):
        return self.used(x)


def test_a_layer_without_input_keeps_its_statistics(caplog):
    model = Branches()
    with caplog.at_level(logging.WARNING):
        update_batch_average(model, iter(make_batches()), num_batches=2)
    assert "unused" in caplog.text
    assert torch.equal(model.unused.running_mean, torch.zeros(4))
    model(torch.ones(1, 3, 2, 2))
    with torch.no_grad():
        model.unused(torch.full((2, 4, 3, 3), 5.0))
    assert torch.allclose(model.unused.running_mean, torch.full((4,), 0.5))  # a momentum update


def test_empty_batches_count_for_nothing():
    model = nn.Sequential(nn.BatchNorm2d(3), SwitchableNorm2d(3))
    batches = [torch.zeros(0, 3, 5, 5), make_batches()[0], torch.zeros(0, 3, 2, 2)]
    update_batch_average(model, iter(batches), num_batches=3)
    values = pixels([batches[1].double()])
    assert_close(model[0].running_var, values.var(1))
    assert model[0].num_batches_tracked == 0
    # the SN layer sees the BN layer's output, normalized with the batch's (biased) statistics
    std = values.var(1, correction=0).add(1e-5).sqrt()
    normalized = (batches[1].double() - values.mean(1)[:, None, None]) / std[:, None, None]
    assert_close(model[1].running_var, pixels([normalized]).var(1, correction=0))


def test_a_failing_forward_restores_everything():
    model = TwoNormNet("SN")
    bn_model = TwoNormNet("BN")
    for net in (model, bn_model):
        state = copy.deepcopy(net.state_dict())

        def batches():
            yield make_batches()[0]
            raise OSError("disk gone")

        with pytest.raises(OSError):
            update_batch_average(net, batches(), num_batches=3)
        for name, value in net.state_dict().items():
            assert torch.equal(value, state[name]), name
        assert net.training
        with torch.no_grad():
            net(make_batches()[1])  # back to momentum updates, no pooling left behind
        assert not torch.equal(net.norm1.running_mean, state["norm1.running_mean"])
    assert bn_model.norm1.momentum == 0.1


def test_a_short_loader_uses_what_it_has(caplog):
    model = TwoNormNet("SN")
    batches = make_batches()[:2]
    inputs = layer_inputs(model, batches)
    with caplog.at_level(logging.WARNING):
        assert update_batch_average(model, iter(batches), num_batches=10) == 2
    assert "ran out" in caplog.text
    assert_statistics(model.norm1, expected_statistics(model.norm1, inputs[0]))
    with pytest.raises(ValueError):
        update_batch_average(model, iter([]), num_batches=1)


class TwoBranches(nn.Module):
    """SyncSN and SN side by side on the same input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.synced = SyncSwitchableNorm2d(4)
        self.local = SwitchableNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.synced(y) + self.local(y)


# Per-process batch sizes (each process reads 3 batches): in "rank 1 starts empty" the layers' first call
# on process 1 carries no value, in "rank 1 all empty" none does.
RANK_BATCH_SIZES = {
    "unequal": [[2, 1, 2], [3, 1, 1]],
    "rank 1 starts empty": [[2, 1, 2], [0, 3, 1]],
    "rank 1 all empty": [[2, 1, 2], [0, 0, 0]],
}


def rank_batches(scenario, rank):
    generator = torch.Generator().manual_seed(100 + rank)
    shapes = [(n, 3, 8, 8) for n in RANK_BATCH_SIZES[scenario][rank]]
    return [torch.randn(shape, generator=generator) + rank for shape in shapes]


def _average_in_process(rank):
    """The batch average on each process with that process's batches: SyncSN stores the statistics of every
    process's batches, bit for bit the same on all; SN those of its own (or keeps its own if it saw none)."""
    world_size = torch.distributed.get_world_size()
    for scenario in RANK_BATCH_SIZES:
        model = TwoBranches()
        before = model.local.running_mean.clone(), model.local.running_var.clone()
        assert update_batch_average(model, iter(rank_batches(scenario, rank)), num_batches=3) == 3
        with torch.no_grad():
            inputs = {r: [model.conv(x).double() for x in rank_batches(scenario, r)] for r in range(world_size)}
        everyone = pixels([x for r in range(world_size) for x in inputs[r]])
        assert_close(model.synced.running_mean, everyone.mean(1), msg=scenario)
        assert_close(model.synced.running_var, everyone.var(1, correction=0), msg=scenario)
        for statistic in (model.synced.running_mean, model.synced.running_var):
            on_each = [torch.empty_like(statistic) for _ in range(world_size)]
            torch.distributed.all_gather(on_each, statistic)
            assert all(torch.equal(other, on_each[0]) for other in on_each), scenario
        own = pixels(inputs[rank])
        if own.shape[1]:
            assert_close(model.local.running_mean, own.mean(1), msg=scenario)
            assert_close(model.local.running_var, own.var(1, correction=0), msg=scenario)
        else:
            assert torch.equal(model.local.running_mean, before[0]), scenario
            assert torch.equal(model.local.running_var, before[1]), scenario


def test_several_processes_syncsn_averages_all_batches_others_their_own():
    run_processes(_average_in_process, (), nprocs=2)
