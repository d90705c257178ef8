"""On a CUDA GPU, PRETRAIN.CUDA_GRAPH trains as eager pretraining does: the same loss at every iteration and
the same backbone after, in float32 and in mixed precision, with evaluations, checkpoints and the batch
average between the replays; its checkpoints are eager training's, so either kind resumes the other, and a
resumed graphed run warms up and captures again. What a replay cannot follow is refused: a batch of
other shapes, storage or momentum buffers replaced after the capture, a hook that acts after the backward.
(Without CUDA the module is skipped; on the CPU: test_graphed_pretraining.py.)

The replay runs the eager step's kernels; only the optimizer differs, torch's fused SGD for its foreach one
(``graph_sgd``), which rounds in another order: so float32 results agree to ~1e-7 per step, which the tiny
network's batch statistics of 4 images amplify, hence tolerances of 1e-4 (TF32 off, so that a weight one
ulp away does not round to another TF32 value). Under mixed precision a weight one ulp away can round to
another float16 value: 2e-3.
"""

import copy
import itertools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from detectron2.engine import AMPTrainer, HookBase, SimpleTrainer
from detectron2.utils.events import EventStorage
from tiny_pretraining import tiny_cfg
from torch import nn

from sn_detection.pretraining.graphed_step import (
    WARMUP_STEPS,
    GraphedAMPTrainer,
    GraphedSteps,
    GraphedTrainer,
)
from sn_detection.pretraining.train import BACKBONE_FILE, pretrain

ITERATIONS = 12
# warm-up over 4 iterations then a cosine: the rate moves at every replay; an evaluation, checkpoints and
# the batch average between replays
RUN = ["MODEL.DEVICE", "cuda", "PRETRAIN.MAX_ITER", str(ITERATIONS), "PRETRAIN.WARMUP_ITERS", "4",
       "PRETRAIN.EVAL_PERIOD", "5", "PRETRAIN.CHECKPOINT_PERIOD", "3"]  # fmt: skip
KILLED_AT = 7  # resumed from the checkpoint after iteration 5: a graphed resume has 3 eager steps and 3 replays
TOLERANCE = {False: {"rtol": 1e-4, "atol": 1e-5}, True: {"rtol": 2e-3, "atol": 1e-3}}  # by PRETRAIN.AMP


@pytest.fixture(scope="module", autouse=True)
def strict_float32():
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = flags


class Interrupted(Exception):
    pass


def run(data, output_dir, *opts, resume=False, killed_at=None):
    """``pretrain`` of the tiny config on CUDA with ``opts``: (the loss of each iteration it trained, the
    number of graph replays)."""
    losses, replays = {}, []
    write_metrics, replay = SimpleTrainer._write_metrics, torch.cuda.CUDAGraph.replay
    steps = {cls: cls.run_step for cls in (SimpleTrainer, AMPTrainer, GraphedSteps)}

    def recording(self, loss_dict, *args, **kwargs):
        losses[self.iter] = loss_dict["loss_cls"].item()
        write_metrics(self, loss_dict, *args, **kwargs)

    def killed(cls):
        def run_step(self):
            if self.iter == killed_at:
                raise Interrupted
            steps[cls](self)

        return run_step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SimpleTrainer, "_write_metrics", recording)
        patch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))
        for cls in steps:
            patch.setattr(cls, "run_step", killed(cls))
        try:
            pretrain(tiny_cfg(data, output_dir, *RUN, *opts), resume=resume)
        except Interrupted:
            assert killed_at is not None
    return losses, len(replays)


def backbone(output_dir):
    return torch.load(output_dir / BACKBONE_FILE, map_location="cpu", weights_only=True)["model"]


def checkpoint(output_dir, iteration):
    return torch.load(output_dir / f"model_{iteration:07d}.pth", map_location="cpu", weights_only=False)


def assert_close_backbones(got, expected, tolerance):
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(expected[key]), **tolerance, msg=key)


@pytest.fixture(scope="module")
def eager_runs(tiny_classification_set, tmp_path_factory):
    """PRETRAIN.AMP -> (losses, output folder) of the uninterrupted eager run."""
    runs = {}
    for amp in (False, True):
        folder = tmp_path_factory.mktemp(f"eager_amp{amp}")
        losses, replays = run(tiny_classification_set, folder, "PRETRAIN.AMP", str(amp))
        assert replays == 0 and sorted(losses) == list(range(ITERATIONS))
        runs[amp] = losses, folder
    return runs


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_graphed_pretraining_trains_as_eager_pretraining(tiny_classification_set, tmp_path, eager_runs, amp):
    eager_losses, eager_folder = eager_runs[amp]
    losses, replays = run(tiny_classification_set, tmp_path, "PRETRAIN.AMP", str(amp), "PRETRAIN.CUDA_GRAPH", "True")
    assert sorted(losses) == list(range(ITERATIONS))
    # the warm-up goes on while float16's first steps overflow and are skipped, until the optimizer has stepped
    assert replays == ITERATIONS - WARMUP_STEPS if not amp else 0 < replays <= ITERATIONS - WARMUP_STEPS
    torch.testing.assert_close(
        [losses[i] for i in range(ITERATIONS)], [eager_losses[i] for i in range(ITERATIONS)], **TOLERANCE[amp]
    )
    assert_close_backbones(backbone(tmp_path), backbone(eager_folder), TOLERANCE[amp])
    # the checkpoints are eager training's: the same entries, the optimizer's groups and state alike
    graphed, eager = checkpoint(tmp_path, 5), checkpoint(eager_folder, 5)
    assert graphed.keys() == eager.keys() and graphed["trainer"].keys() == eager["trainer"].keys()
    graphed, eager = graphed["trainer"], eager["trainer"]
    assert graphed["optimizer"]["param_groups"] == eager["optimizer"]["param_groups"]
    assert graphed["optimizer"]["state"].keys() == eager["optimizer"]["state"].keys()
    for index, state in eager["optimizer"]["state"].items():
        torch.testing.assert_close(
            graphed["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"], **TOLERANCE[amp]
        )
    if amp:  # GradScaler's skips and growth, on the device, as the eager trainer's on the host
        assert graphed["grad_scaler"] == eager["grad_scaler"]


@pytest.mark.parametrize(
    "first, then",
    [(True, True), (True, False), (False, True)],
    ids=["graphed-graphed", "graphed-eager", "eager-graphed"],
)
def test_a_resumed_run_trains_as_an_uninterrupted_one(tiny_classification_set, tmp_path, eager_runs, first, then):
    eager_losses, eager_folder = eager_runs[False]
    _, replays = run(tiny_classification_set, tmp_path, "PRETRAIN.CUDA_GRAPH", str(first), killed_at=KILLED_AT)
    assert replays == (KILLED_AT - WARMUP_STEPS if first else 0)
    losses, replays = run(tiny_classification_set, tmp_path, "PRETRAIN.CUDA_GRAPH", str(then), resume=True)
    resumed_at = 6  # after the checkpoint of iteration 5
    assert sorted(losses) == list(range(resumed_at, ITERATIONS))
    assert replays == (ITERATIONS - resumed_at - WARMUP_STEPS if then else 0)  # it warms up and captures again
    torch.testing.assert_close(
        [losses[i] for i in sorted(losses)], [eager_losses[i] for i in sorted(losses)], **TOLERANCE[False]
    )
    assert_close_backbones(backbone(tmp_path), backbone(eager_folder), TOLERANCE[False])


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, batch):
        inputs, targets = (t.to(self.linear.weight.device) for t in batch)
        return {"loss": ((self.linear(inputs) - targets) ** 2).mean()}


def captured_trainer(batches, trainer_class=GraphedTrainer, **options):
    """A graphed trainer of a small regression on CUDA, stepped until its first replay."""
    torch.manual_seed(0)
    model = Regression().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    trainer = trainer_class(model, batches, optimizer, **options)
    with EventStorage():
        for _ in range(WARMUP_STEPS + 1):
            trainer.run_step()
    assert trainer.captured
    return trainer


def batches(*sizes):
    generator = torch.Generator().manual_seed(0)
    return iter([(torch.randn(n, 3, generator=generator), torch.randn(n, 1, generator=generator)) for n in sizes])


def test_a_batch_of_other_shapes_is_refused():
    trainer = captured_trainer(batches(4, 4, 4, 4, 4, 3))
    with EventStorage():
        trainer.run_step()
        with pytest.raises(
            ValueError,
            match=r"PRETRAIN.CUDA_GRAPH=True replays the step captured for batches of "
            r"\(shape, dtype\) \[\(\(4, 3\), torch.float32\), \(\(4, 1\), "
            r"torch.float32\)\], but got \[\(\(3, 3\), .*every batch must have the "
            r"same shapes",
        ):
            trainer.run_step()


def test_replaced_storage_is_refused():
    trainer = captured_trainer(itertools.repeat(next(batches(4))))
    trainer.model.linear.weight.data = trainer.model.linear.weight.detach().clone()
    with EventStorage(), pytest.raises(RuntimeError, match="the model's parameters or buffers were given new storage"):
        trainer.run_step()

    trainer = captured_trainer(itertools.repeat(next(batches(4))))
    trainer.optimizer.load_state_dict(copy.deepcopy(trainer.optimizer.state_dict()))
    with EventStorage(), pytest.raises(RuntimeError, match="the optimizer's momentum buffers were replaced"):
        trainer.run_step()


def test_what_cannot_run_inside_a_replay_is_refused():
    class ClipsGradients(HookBase):
        def after_backward(self):
            pass

    trainer = captured_trainer(itertools.repeat(next(batches(4))))
    with pytest.raises(ValueError, match=r"hooks that act between them \(after_backward\) cannot run; got Clips"):
        trainer.register_hooks([ClipsGradients()])
    with pytest.raises(ValueError, match="log_grad_scaler reads the scale between the backward and the optimizer step"):
        GraphedAMPTrainer(
            Regression().cuda(), None, torch.optim.SGD(Regression().parameters(), lr=0.1), log_grad_scaler=True
        )
