"""A training interrupted right after a checkpoint and resumed computes what the uninterrupted training
computes (sn_detection.engine.resume): the same losses and learning rate at every iteration and, bit for
bit, the same final checkpoint (weights, the norms' running and batch-averaged statistics, DN's gates,
optimizer momentum, LR scheduler, hook states). Plus the loader that makes it possible."""

import itertools

import pytest
import torch
from detectron2.data import build_detection_train_loader, get_detection_dataset_dicts
from detectron2.data.samplers import TrainingSampler
from detectron2.engine import HookBase
from detectron2.utils.env import seed_all_rng
from shrunk_training import MIXED_NORMS, shrunk_cfg

from sn_detection.engine import Trainer
from sn_detection.engine.resume import BatchStreamSampler, build_train_loader

MAX_ITER = 4
CHECKPOINT_PERIOD = 2  # the interrupted run stops right after the checkpoint of iteration 1
# The batch average runs every 2 iterations, so also before the checkpoint the resumed run starts from.
RESUME_OPTS = [
    *MIXED_NORMS,
    "SEED",
    "3",
    "SOLVER.MAX_ITER",
    str(MAX_ITER),
    "TEST.EVAL_PERIOD",
    "2",
    "SOLVER.CHECKPOINT_PERIOD",
    str(CHECKPOINT_PERIOD),
]


class Interrupted(Exception):
    pass


class InterruptAfter(HookBase):
    """Stops the training after ``iteration``, as a killed job would (registered last, so after the
    checkpointer)."""

    def __init__(self, iteration):
        self._iteration = iteration

    def after_step(self):
        if self.trainer.iter == self._iteration:
            raise Interrupted


class RecordLosses(HookBase):
    """Each iteration's losses and learning rate, by iteration."""

    def __init__(self, record):
        self._record = record

    def after_step(self):
        latest = self.trainer.storage.latest()
        self._record[self.trainer.iter] = {
            name: value
            for name, (value, iteration) in latest.items()
            if iteration == self.trainer.iter and (name.startswith("loss") or name in ("total_loss", "lr"))
        }


def train(cfg, hooks, resume=False):
    seed_all_rng(cfg.SEED)  # what default_setup does for the single process
    trainer = Trainer(cfg)
    trainer.register_hooks(hooks)
    trainer.resume_or_load(resume=resume)
    trainer.train()


def assert_same(got, expected, path="checkpoint"):
    assert type(got) is type(expected), path
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), path
        for key in expected:
            assert_same(got[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), path
    else:
        assert got == expected, path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run and the interrupted one, each with its folder and records; the interrupted
    run's records before and after the interruption are kept apart."""
    uninterrupted, before, after = {}, {}, {}
    straight_dir, resumed_dir = tmp_path_factory.mktemp("uninterrupted"), tmp_path_factory.mktemp("resumed")
    train(shrunk_cfg(straight_dir, *RESUME_OPTS), [RecordLosses(uninterrupted)])
    with pytest.raises(Interrupted):
        train(shrunk_cfg(resumed_dir, *RESUME_OPTS), [RecordLosses(before), InterruptAfter(CHECKPOINT_PERIOD - 1)])
    train(shrunk_cfg(resumed_dir, *RESUME_OPTS), [RecordLosses(after)], resume=True)
    return (straight_dir, uninterrupted), (resumed_dir, before, after)


def test_losses_and_learning_rate_of_every_iteration_are_the_same(runs):
    (_, uninterrupted), (_, before, after) = runs
    assert sorted(uninterrupted) == list(range(MAX_ITER))
    # the resumed run started at the checkpoint: a run that trained again from 0 would match too
    assert sorted(before) == list(range(CHECKPOINT_PERIOD))
    assert sorted(after) == list(range(CHECKPOINT_PERIOD, MAX_ITER))
    resumed = {**before, **after}
    for iteration in range(MAX_ITER):
        assert resumed[iteration] == uninterrupted[iteration], iteration
        assert {"total_loss", "loss_cls", "loss_mask", "lr"} <= set(uninterrupted[iteration])


def test_final_checkpoints_are_identical(runs):
    (straight_dir, _), (resumed_dir, _, _) = runs
    expected = torch.load(straight_dir / "model_final.pth")
    got = torch.load(resumed_dir / "model_final.pth")
    model = expected["model"]
    for kind in ("running_mean", "running_var", "channel_gates", "batch_gate", "mean_weight", "gate.weight"):
        assert any(key.endswith(kind) for key in model), f"the model has no {kind} to compare"
    assert expected["trainer"]["hooks"]["BatchAverage"] == {"batches_read": 4}
    assert_same(got, expected)


def test_training_changed_the_statistics_it_is_compared_on(runs):
    """Guards the comparison above against a vacuous pass: the checkpoint of the interrupted run and
    the final one differ in weights and in batch-averaged statistics."""
    (_, _), (resumed_dir, _, _) = runs
    middle = torch.load(resumed_dir / f"model_{CHECKPOINT_PERIOD - 1:07d}.pth")["model"]
    final = torch.load(resumed_dir / "model_final.pth")["model"]
    changed = {key for key in final if not torch.equal(final[key], middle[key])}
    assert any(key.endswith("running_var") for key in changed)
    assert any(key.endswith("conv1.weight") for key in changed)


def file_names(loader, num_batches):
    return [[d["file_name"] for d in batch] for batch in itertools.islice(loader, num_batches)]


def test_a_loader_started_at_batch_k_continues_the_stream(tmp_path):
    cfg = shrunk_cfg(tmp_path, "SEED", "5")
    whole = file_names(build_train_loader(cfg), 5)
    assert file_names(build_train_loader(cfg, start_batch=3), 2) == whole[3:]
    cfg.DATALOADER.ASPECT_RATIO_GROUPING = False
    whole = file_names(build_train_loader(cfg), 4)
    assert file_names(build_train_loader(cfg, start_batch=1), 3) == whole[1:]


@pytest.mark.parametrize("batch_size", [2, 3])
def test_index_grouped_batches_are_detectron2s_aspect_ratio_groups(batch_size):
    """detectron2 groups the mapped images by their width and height; grouping the indices by the
    dataset dicts' sizes gives the same batches, in the same order, before any image is read."""
    dataset = get_detection_dataset_dicts(["sn_shapes_train"])
    group_ids = [0 if d["width"] > d["height"] else 1 for d in dataset]
    assert 0 < sum(group_ids) < len(group_ids), "both groups should occur"

    def loader(**kwargs):
        return build_detection_train_loader(
            dataset, mapper=lambda d: d, total_batch_size=batch_size, num_workers=0, **kwargs
        )

    grouped = loader(sampler=TrainingSampler(len(dataset), seed=7), aspect_ratio_grouping=True)
    sampler = BatchStreamSampler(TrainingSampler(len(dataset), seed=7), batch_size, group_ids, start_batch=0)
    ours = loader(sampler=sampler, aspect_ratio_grouping=False)
    assert file_names(ours, 20) == file_names(grouped, 20)
