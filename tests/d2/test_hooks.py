"""The batch average as a detectron2 hook: it runs before each evaluation and checkpoint and after training,
on fresh batches of a loader of its own, and resumes where it stopped. (What the average computes:
tests/layers/test_batch_average.py.)"""

import copy

import torch
from batch_average_nets import (
    TwoNormNet,
    Untouchable,
    assert_statistics,
    expected_statistics,
    layer_inputs,
    make_batches,
)
from detectron2.config import get_cfg
from detectron2.engine import SimpleTrainer
from detectron2.engine.hooks import EvalHook, IterationTimer, PeriodicCheckpointer
from torch import nn

from sn_detection.d2 import add_sn_config
from sn_detection.d2.hooks import BatchAverage, build_batch_average_hook, insert_before_evaluation
from sn_detection.layers import GroupNorm2d, SwitchableNorm2d


def batch_average_cfg(num_batches=3, eval_period=2):
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.TEST.BATCH_AVERAGE.ENABLED = True
    cfg.TEST.BATCH_AVERAGE.NUM_BATCHES = num_batches
    cfg.TEST.EVAL_PERIOD = eval_period
    cfg.DATALOADER.NUM_WORKERS = 4
    return cfg


def test_hook_order_puts_it_before_checkpointing_and_evaluation():
    timer, evaluation = IterationTimer(), EvalHook(0, dict)
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


def test_no_hook_without_batch_statistics():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), GroupNorm2d(8, num_groups=4), SwitchableNorm2d(8, use_bn=False))
    assert build_batch_average_hook(batch_average_cfg(), model, lambda cfg, start_batch: Untouchable()) is None
