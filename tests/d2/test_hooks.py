"""The batch average (SN paper, Sec. 2.1): after it, each layer's test statistics are those of the
concatenation of the training batches it saw, computed here naively from the layer inputs."""

import copy
import logging

import pytest
import torch
from detectron2.config import get_cfg
from detectron2.engine import SimpleTrainer
from detectron2.engine.hooks import EvalHook, IterationTimer, PeriodicCheckpointer
from torch import nn

from sn_detection.d2.hooks import (
    BatchAverage,
    build_batch_average_hook,
    insert_before_evaluation,
    update_batch_average,
)
from sn_detection.layers import (
    DynamicNorm2d,
    GroupNorm2d,
    ModeNorm2d,
    SkewnessReducedBatchNorm2d,
    SwitchableNorm2d,
    SyncSwitchableNorm2d,
)

NORMS = {
    "SN": lambda c: SwitchableNorm2d(c),
    "BNSR": lambda c: SkewnessReducedBatchNorm2d(c),
    "MN": lambda c: ModeNorm2d(c, num_modes=2),
    "DN": lambda c: DynamicNorm2d(c, init_groups=4, init_batch_pool=True),
    "BN": lambda c: nn.BatchNorm2d(c),
}


class TwoNormNet(nn.Module):
    """conv - norm - relu - conv - norm: the second norm's input depends on the first's batch statistics."""

    def __init__(self, norm):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1 = NORMS[norm](8)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.norm2 = NORMS[norm](8)

    def norms(self):
        return [self.norm1, self.norm2]

    def forward(self, x):
        y = self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x)))))
        return {"loss": y.square().mean()}


def make_batches(seed=1):
    """Batches of different sizes and shapes: pooling must weight them by their number of values."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, 3, 9, 9), (3, 3, 7, 11), (1, 3, 12, 8)]
    return [torch.randn(shape, generator=generator) * 2 + 0.5 for shape in shapes]


def layer_inputs(model, batches):
    """The inputs each norm of (a copy of) the model receives when the batches run in training mode."""
    model = copy.deepcopy(model).train()
    inputs = {i: [] for i in range(len(model.norms()))}
    for i, norm in enumerate(model.norms()):
        norm.register_forward_pre_hook(lambda m, args, i=i: inputs[i].append(args[0].detach().double()))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    return [inputs[i] for i in range(len(inputs))]


def pixels(inputs):
    """All values of each channel over every sample and position of every batch: (C, total)."""
    return torch.cat([x.transpose(0, 1).flatten(1) for x in inputs], dim=1)


def expected_statistics(norm, inputs):
    """The naive statistics of the concatenated inputs, in the layer's buffer convention."""
    values = pixels(inputs)
    if isinstance(norm, ModeNorm2d):
        # every pixel of sample s counts for mode k with weight g_sk = softmax(gate(mean_HW(x_s)))_k
        weights, first, second = [], [], []
        for x in inputs:
            gates = torch.softmax(norm.gate.double()(x.mean((2, 3))), dim=1)  # (N, K)
            area = x.shape[2] * x.shape[3]
            weights.append(gates.sum(0) * area)
            first.append(torch.einsum("nk,nchw->kc", gates, x))
            second.append(torch.einsum("nk,nchw->kc", gates, x.square()))
        total = sum(weights)[:, None]
        return {"running_mean": sum(first) / total, "running_sq_mean": sum(second) / total}
    unbiased = isinstance(norm, (nn.BatchNorm2d, SkewnessReducedBatchNorm2d))
    return {"running_mean": values.mean(1), "running_var": values.var(1, correction=1 if unbiased else 0)}


def assert_close(actual, expected, msg=None):
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6, msg=msg)


def assert_statistics(norm, expected):
    for name, value in expected.items():
        assert_close(getattr(norm, name), value, msg=name)


def parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


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


def test_frozen_and_eval_mode_layers_are_left_alone():
    model = TwoNormNet("SN")
    model.norm1.freeze()
    frozen = model.norm1.running_mean.clone()
    model.train()
    update_batch_average(model, iter(make_batches()), num_batches=2)
    assert torch.equal(model.norm1.running_mean, frozen)
    assert not torch.equal(model.norm2.running_mean, torch.zeros(8))


class Untouchable:
    def __iter__(self):
        return self

    def __next__(self):
        raise AssertionError("a model without batch statistics must not read any batch")


def test_no_op_without_batch_statistics():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), GroupNorm2d(8, num_groups=4), SwitchableNorm2d(8, use_bn=False))
    state = copy.deepcopy(model.state_dict())
    assert update_batch_average(model, Untouchable(), num_batches=5) == 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name])
    cfg = batch_average_cfg()
    assert build_batch_average_hook(cfg, model, lambda cfg, start_batch: Untouchable()) is None


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


def batch_average_cfg(num_batches=3, eval_period=2):
    from sn_detection.d2.config import add_sn_config

    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.TEST.BATCH_AVERAGE.ENABLED = True
    cfg.TEST.BATCH_AVERAGE.NUM_BATCHES = num_batches
    cfg.TEST.EVAL_PERIOD = eval_period
    cfg.DATALOADER.NUM_WORKERS = 4
    return cfg


def test_hook_order_puts_it_before_checkpointing_and_evaluation():
    timer, evaluation = IterationTimer(), EvalHook(0, lambda: {})
    checkpointer = PeriodicCheckpointer.__new__(PeriodicCheckpointer)
    hook = BatchAverage(nn.Identity(), list, num_batches=1, period=0)
    hooks = [timer, None, checkpointer, evaluation]
    assert insert_before_evaluation(hooks, hook) == [timer, None, hook, checkpointer, evaluation]
    assert insert_before_evaluation([timer, evaluation], hook) == [timer, hook, evaluation]
    assert insert_before_evaluation([timer], hook) == [timer, hook]
    assert insert_before_evaluation([timer, evaluation], None) == [timer, evaluation]


def test_disabled_by_config():
    cfg = batch_average_cfg()
    cfg.TEST.BATCH_AVERAGE.ENABLED = False
    assert build_batch_average_hook(cfg, TwoNormNet("SN"), lambda cfg, start_batch: Untouchable()) is None


def test_in_a_trainer_before_each_evaluation_and_at_the_end():
    """SimpleTrainer, 4 iterations, evaluation every 2: the hook (inserted before the EvalHook) averages
    3 fresh batches of its own loader before each evaluation, with the parameters of that moment."""
    model = TwoNormNet("SN")
    train_batches = make_batches(seed=10) + make_batches(seed=11)
    average_batches = make_batches(seed=20) + make_batches(seed=21) + make_batches(seed=22)
    loaders = []

    def build_loader(cfg, start_batch):
        loaders.append((cfg.DATALOADER.NUM_WORKERS, cfg.SEED, start_batch))
        return average_batches[start_batch:]

    evaluations = []

    def evaluate():
        evaluations.append(copy.deepcopy(model.state_dict()))
        return {}

    cfg = batch_average_cfg(num_batches=3, eval_period=2)
    cfg.SEED = 7
    hook = build_batch_average_hook(cfg, model, build_loader)
    assert loaders == []  # built lazily, on the first run
    trainer = SimpleTrainer(model, train_batches, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.register_hooks(insert_before_evaluation([EvalHook(2, evaluate)], hook))
    trainer.train(0, 4)

    assert loaders == [(0, 8, 0)]  # no workers, a stream of its own, from its beginning
    assert len(evaluations) == 2
    for state, batches in zip(evaluations, (average_batches[:3], average_batches[3:6])):
        reference = TwoNormNet("SN")
        reference.load_state_dict(state)
        inputs = layer_inputs(reference, batches)
        for layer, layer_input in zip(reference.norms(), inputs):
            assert_statistics(layer, expected_statistics(layer, layer_input))
    assert torch.equal(model.norm2.running_var, evaluations[-1]["norm2.running_var"])
    assert model.training


def test_a_resumed_hook_reads_on_where_it_stopped():
    """The hook's state (batches read), saved in the trainer's checkpoints, makes a new hook build its
    loader from the next unread batch: it averages what the first hook would have averaged next."""
    average_batches = make_batches(seed=20) + make_batches(seed=21)
    starts = []

    def build_loader(cfg, start_batch):
        starts.append(start_batch)
        return average_batches[start_batch:]

    cfg = batch_average_cfg(num_batches=2)
    first = build_batch_average_hook(cfg, TwoNormNet("SN"), build_loader)
    assert first.update() == 2 and first.state_dict() == {"batches_read": 2}
    model = TwoNormNet("SN")
    resumed = build_batch_average_hook(cfg, model, build_loader)
    resumed.load_state_dict(first.state_dict())
    assert resumed.update() == 2 and resumed.state_dict() == {"batches_read": 4}
    assert starts == [0, 2]
    for layer, layer_input in zip(model.norms(), layer_inputs(TwoNormNet("SN"), average_batches[2:4])):
        assert_statistics(layer, expected_statistics(layer, layer_input))


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


def _average_in_process(rank, world_size, init_file):
    """The hook on each process with that process's batches: SyncSN stores the statistics of every
    process's batches, bit for bit the same on all; SN those of its own (or keeps its own if it saw none)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        for scenario in RANK_BATCH_SIZES:
            model = TwoBranches()
            before = model.local.running_mean.clone(), model.local.running_var.clone()
            hook = build_batch_average_hook(
                batch_average_cfg(num_batches=3), model, lambda cfg, start: rank_batches(scenario, rank)[start:]
            )
            assert hook.update() == 3
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
    finally:
        torch.distributed.destroy_process_group()


def test_several_processes_syncsn_averages_all_batches_others_their_own(tmp_path):
    torch.multiprocessing.spawn(_average_in_process, args=(2, str(tmp_path / "init")), nprocs=2)
