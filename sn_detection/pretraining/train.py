"""Image-classification pretraining of a detection config's ResNet (``tools/pretrain_backbone.py``), with
detectron2's engine: its ``SimpleTrainer`` / ``AMPTrainer``, hooks (ETA and losses printed every 20
iterations, metrics.json, periodic checkpoints, evaluation) and ``launch`` (K processes, NCCL on GPUs and
gloo on the CPU; several machines).

The schedule is the usual one for ImageNet: SGD with Nesterov momentum, a linear warm-up from 0.1 % of
PRETRAIN.BASE_LR over PRETRAIN.WARMUP_ITERS, then a cosine to 0 at PRETRAIN.MAX_ITER (PRETRAIN.STOP_ITER
k > 0 trains only its first k iterations: the same run cut short, the learning rate still that of the
MAX_ITER schedule, then the batch average and the final evaluation as at its end; PRETRAIN.STOP_TOP1 X > 0
cuts it short likewise at the first evaluation, every PRETRAIN.EVAL_PERIOD iterations, whose top-1 with
the moving averages is at least X %, and ``results.json`` says where); weight decay on
the convolutions and the classifier's weight only (none on norms and biases; the gates of our norms have
their own learning-rate factor, ``sn_detection.d2.optimizer``). PRETRAIN.IMS_PER_BATCH is the batch over
all processes: large batches are the point of pretraining (BN, and SN's BN branch, see them), so each
process holds IMS_PER_BATCH / K images and PRETRAIN.SYNC_NORMS pools SN's and BN's statistics over all.
After the last iteration the batch-dependent test statistics become the exact statistics of
PRETRAIN.BATCH_AVERAGE_BATCHES further training batches (the SN paper's batch average, as detectron2's
PreciseBN), before the final evaluation and checkpoint. With PRETRAIN.CUDA_GRAPH the step is captured in a
CUDA graph after a few eager ones and replayed (``graphed_step``): the same training, less host time.

Outputs in PRETRAIN.OUTPUT_DIR: ``backbone.pth`` (the backbone checkpoint, ``model``), ``results.json``
(top-1 on the val split, the input convention, what was trained and how long), ``metrics.json``,
``log.txt`` and the training checkpoints ``model_*.pth`` that ``--resume`` continues from: the weights,
optimizer, schedule and iteration, and the data stream restarts at the next unread sample with the same
crops and flips (``data``), so a resumed run trains as an uninterrupted one.

A run with PRETRAIN.KEEP_EVALUATED_MODELS keeps its model at each periodic evaluation (``evaluated/``), from
which ``stop_at_evaluation`` makes what a run stopped at a top-1 there ends with (``top1_stop``). The backbone
cache (``cache``) calls ``pretrain``.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch
from detectron2.config import CfgNode
from detectron2.data.samplers import TrainingSampler
from detectron2.engine import HookBase, SimpleTrainer, hooks
from detectron2.solver import LRMultiplier, WarmupParamScheduler
from detectron2.utils import comm
from detectron2.utils.env import seed_all_rng
from detectron2.utils.events import CommonMetricPrinter, JSONWriter, get_event_storage
from fvcore.common.param_scheduler import CosineParamScheduler
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..conversion import InputConvention
from ..conversion.files import write_checkpoint
from ..d2.checkpointer import CheckedCheckpointer, check_resumed_iteration
from ..d2.hooks import batch_average_hook, radius_hook
from ..d2.optimizer import GateClippingSGD, get_optimizer_params
from ..d2.trainers import share_first_process_buffers, step_trainer
from .data import ClassificationImages, SeededStream, collate, data_folder, shard
from .graphed_step import GraphedAMPTrainer, GraphedTrainer
from .model import BackboneClassifier, backbone_state, input_convention, pretrained_norm

logger = logging.getLogger(__name__)

BACKBONE_FILE = "backbone.pth"
RESULTS_FILE = "results.json"
METRICS_FILE = "metrics.json"
EVALUATED_FOLDER = "evaluated"  # the model at each periodic evaluation (PRETRAIN.KEEP_EVALUATED_MODELS)
LOG_PERIOD = 20
WARMUP_FACTOR = 0.001


def per_process_batch(cfg: CfgNode) -> int:
    world_size = comm.get_world_size()
    if cfg.PRETRAIN.IMS_PER_BATCH % world_size:
        raise ValueError(
            f"PRETRAIN.IMS_PER_BATCH={cfg.PRETRAIN.IMS_PER_BATCH} is not divisible by the {world_size} processes"
        )
    return cfg.PRETRAIN.IMS_PER_BATCH // world_size


def build_optimizer(cfg: CfgNode, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = get_optimizer_params(
        model,
        base_lr=cfg.PRETRAIN.BASE_LR,
        weight_decay_norm=0.0,
        weight_decay_bias=0.0,
        gate_lr_factor=cfg.PRETRAIN.GATE_LR_FACTOR,
        gate_weight_decay=0.0,
        ssn_gate_lr_factor=cfg.PRETRAIN.SSN_GATE_LR_FACTOR,
        ssn_gate_clip_norm=cfg.PRETRAIN.SSN_GATE_CLIP_NORM,
    )
    return GateClippingSGD(
        params,
        lr=cfg.PRETRAIN.BASE_LR,
        momentum=cfg.PRETRAIN.MOMENTUM,
        nesterov=True,
        weight_decay=cfg.PRETRAIN.WEIGHT_DECAY,
    )


def build_schedule(cfg: CfgNode, optimizer) -> LRMultiplier:
    max_iter = cfg.PRETRAIN.MAX_ITER
    multiplier = WarmupParamScheduler(
        CosineParamScheduler(1.0, 0.0), WARMUP_FACTOR, min(cfg.PRETRAIN.WARMUP_ITERS / max_iter, 1.0), "linear"
    )
    return LRMultiplier(optimizer, multiplier, max_iter)


def trained_iterations(cfg: CfgNode) -> int:
    """How many iterations of the PRETRAIN.MAX_ITER schedule are trained: PRETRAIN.STOP_ITER, 0 for all; with
    PRETRAIN.STOP_TOP1, at most that many."""
    return cfg.PRETRAIN.STOP_ITER or cfg.PRETRAIN.MAX_ITER


def build_trainer(cfg: CfgNode, model: torch.nn.Module, optimizer, data_loader=None) -> SimpleTrainer:
    """detectron2's trainer of one pretraining step, of ``model`` in DDP, in mixed precision with PRETRAIN.AMP,
    the step captured in a CUDA graph and replayed with PRETRAIN.CUDA_GRAPH (``graphed_step``)."""
    trainer_classes = (GraphedTrainer, GraphedAMPTrainer) if cfg.PRETRAIN.CUDA_GRAPH else None
    return step_trainer(
        model, data_loader, optimizer, cfg.PRETRAIN.AMP, "PRETRAIN.AMP", trainer_classes, broadcast_buffers=False
    )


def train_loader(cfg: CfgNode, images: ClassificationImages, start_iter: int) -> DataLoader:
    """This process's batches, from iteration ``start_iter`` on (``data``: resumed exactly)."""
    batch = per_process_batch(cfg)
    seed = cfg.SEED if cfg.SEED >= 0 else 0
    sampler = TrainingSampler(len(images), shuffle=True, seed=seed)
    stream = SeededStream(sampler, seed, comm.get_rank(), comm.get_world_size(), start=start_iter * batch)
    return DataLoader(
        images,
        batch_size=batch,
        sampler=stream,
        num_workers=cfg.PRETRAIN.NUM_WORKERS,
        collate_fn=collate,
        persistent_workers=cfg.PRETRAIN.NUM_WORKERS > 0,
    )


@torch.no_grad()
def top1(cfg: CfgNode, model: torch.nn.Module, images: ClassificationImages) -> float:
    """Top-1 accuracy (%) on ``images``, each process classifying its shard."""
    module = model.module if hasattr(model, "module") else model
    training = module.training
    module.eval()
    indices = shard(len(images), comm.get_rank(), comm.get_world_size())
    loader = DataLoader(
        torch.utils.data.Subset(images, indices),
        batch_size=per_process_batch(cfg),
        num_workers=cfg.PRETRAIN.NUM_WORKERS,
        collate_fn=collate,
    )
    correct = 0
    for pixels, labels in loader:
        correct += int((module.logits(pixels.to(module.pixel_mean.device)).argmax(1).cpu() == labels).sum())
    module.train(training)
    counts = comm.all_gather((correct, len(indices)))
    return 100.0 * sum(c for c, _ in counts) / max(sum(n for _, n in counts), 1)


class TargetReached(BaseException):
    """Ends detectron2's training loop at PRETRAIN.STOP_TOP1. A BaseException, so that the trainer's
    ``except Exception`` does not log it as a failure; its ``finally`` still runs the hooks' ``after_train``."""


class Evaluation(HookBase):
    """Top-1 on the val split every PRETRAIN.EVAL_PERIOD iterations and after the last one, into the
    event storage (metrics.json) and the log; with PRETRAIN.STOP_TOP1 X, the last one is the first
    periodic evaluation that reaches X.

    It comes before the batch average and the ``Checkpointer`` in the hooks: an evaluation that reaches
    X makes its iteration the trainer's last (``trainer.max_iter``), so that the batch average runs there
    and the final checkpoint written there holds it and this hook's state (``reached_at``); the next iteration's
    ``before_step`` ends the loop. A run resumed from that checkpoint ends at once, as the uninterrupted
    one did; one killed before it repeats the evaluation. The final evaluation (``after_train``, after the
    batch average) is skipped only when training failed, as in detectron2's EvalHook. With ``keep_in`` (the
    main process's output folder, under PRETRAIN.KEEP_EVALUATED_MODELS) the model is saved into it at each
    periodic evaluation (``save_evaluated_model``)."""

    def __init__(self, cfg, model, images, keep_in: str | None = None):
        self._period, self._target = cfg.PRETRAIN.EVAL_PERIOD, cfg.PRETRAIN.STOP_TOP1
        self._evaluate = lambda: self._top1(cfg, model, images)
        self._model, self._keep_in = model, keep_in
        self.latest = None
        self.reached_at = None  # iterations trained when a periodic evaluation reached STOP_TOP1

    def _top1(self, cfg, model, images):
        share_first_process_buffers(model)  # the statistics backbone.pth holds, in every process
        self.latest = top1(cfg, model, images)
        logger.info("Top-1 on the val split (%d images): %.2f %%", len(images), self.latest)
        get_event_storage().put_scalar("val_top1", self.latest, smoothing_hint=False)
        comm.synchronize()

    def before_train(self):
        if self.reached_at is not None:  # resumed from the checkpoint of the evaluation that reached it
            self.trainer.max_iter = self.reached_at

    def before_step(self):
        if self.reached_at is not None and self.trainer.iter >= self.reached_at:
            raise TargetReached()

    def after_step(self):
        done = self.trainer.iter + 1
        if self._period > 0 and done % self._period == 0 and done != self.trainer.max_iter:
            self._evaluate()
            if self._keep_in is not None:
                save_evaluated_model(self._model, self._keep_in, done)
            if self._target and self.latest >= self._target:
                logger.info(
                    "Top-1 %.2f %% reached PRETRAIN.STOP_TOP1=%g after %d iterations: training stops here",
                    self.latest,
                    self._target,
                    done,
                )
                self.reached_at = self.trainer.max_iter = done

    def after_train(self):
        if self.trainer.iter + 1 >= self.trainer.max_iter:
            self._evaluate()

    def state_dict(self) -> dict:
        return {"reached_at": self.reached_at} if self._target else {}

    def load_state_dict(self, state: dict) -> None:
        if self._target:  # a stopped run resumed without its stop trains on
            self.reached_at = state["reached_at"]


class Checkpointer(hooks.PeriodicCheckpointer):
    """detectron2's PeriodicCheckpointer, which also writes ``model_final`` where PRETRAIN.STOP_TOP1 made an
    iteration the last (``Evaluation``): detectron2's reads ``trainer.max_iter`` once, before training."""

    def after_step(self):
        self.max_iter = self.trainer.max_iter
        super().after_step()


def _splits(cfg: CfgNode) -> tuple[str, ClassificationImages, ClassificationImages]:
    """PRETRAIN.DATA's folder and its train and val splits, as ``cfg`` reads them."""
    folder = data_folder(cfg.PRETRAIN.DATA)
    size, area, image_format = cfg.PRETRAIN.IMAGE_SIZE, cfg.PRETRAIN.CROP_AREA, cfg.INPUT.FORMAT
    train_images = ClassificationImages(folder, "train", size, area, image_format)
    val_images = ClassificationImages(folder, "val", size, area, image_format)
    if val_images.classes != train_images.classes:
        raise ValueError(f"{folder}: the val split's classes differ from the train split's")
    return folder, train_images, val_images


def pretrain(cfg: CfgNode, resume: bool = False, output_dir: str | None = None) -> dict:
    """Pretrain the ResNet of ``cfg`` in this process (of ``comm.get_world_size()``); writes the outputs
    (module docstring) into ``output_dir`` (default PRETRAIN.OUTPUT_DIR) and returns the results."""
    output_dir = output_dir or cfg.PRETRAIN.OUTPUT_DIR
    stop_iter = trained_iterations(cfg)
    os.makedirs(output_dir, exist_ok=True)
    folder, train_images, val_images = _splits(cfg)

    # as detectron2's default_setup seeds: a fixed SEED gives the same initial network (DDP broadcasts rank 0's)
    seed_all_rng(None if cfg.SEED < 0 else cfg.SEED + comm.get_rank())
    model = BackboneClassifier(cfg, len(train_images.classes)).to(cfg.MODEL.DEVICE)
    optimizer = build_optimizer(cfg, model)
    trainer = build_trainer(cfg, model, optimizer)
    ddp = trainer.model
    checkpointer = CheckedCheckpointer(ddp, output_dir, trainer=trainer)
    schedule = build_schedule(cfg, optimizer)
    main_process = comm.is_main_process()
    keep_in = output_dir if keeps_evaluated_models(cfg) and main_process else None
    evaluation = Evaluation(cfg, ddp, val_images, keep_in)
    batches = cfg.PRETRAIN.BATCH_AVERAGE_BATCHES
    average = (
        batch_average_hook(
            ddp, lambda start: train_loader(cfg, train_images, cfg.PRETRAIN.MAX_ITER + start), batches, period=0
        )
        if batches
        else None
    )
    trainer.register_hooks(
        [
            radius_hook(ddp, cfg.PRETRAIN.MAX_ITER, *cfg.PRETRAIN.SSN_RADIUS),
            hooks.IterationTimer(),
            hooks.LRScheduler(optimizer, schedule),
            evaluation,  # before the batch average and the checkpointer: it may make this iteration the last
            average,
            Checkpointer(checkpointer, cfg.PRETRAIN.CHECKPOINT_PERIOD) if main_process else None,
            hooks.PeriodicWriter(
                [CommonMetricPrinter(stop_iter), JSONWriter(os.path.join(output_dir, METRICS_FILE))],
                period=LOG_PERIOD,
            )
            if main_process
            else None,
        ]
    )
    start_iter = 0
    if resume and checkpointer.has_checkpoint():
        checkpointer.resume_or_load("", resume=True)
        start_iter = trainer.iter + 1
        check_resumed_iteration(
            start_iter, stop_iter, "PRETRAIN.STOP_ITER" if cfg.PRETRAIN.STOP_ITER else "PRETRAIN.MAX_ITER", output_dir
        )
    trainer.data_loader = train_loader(cfg, train_images, start_iter)
    logger.info(
        "Pretraining %s-%d with %s norms on %d images of %d classes (%s), %d px, %d per batch, iterations %d-%d, "
        "of a %d-iteration schedule, on %s",
        "ResNet",
        cfg.MODEL.RESNETS.DEPTH,
        pretrained_norm(cfg),
        len(train_images),
        len(train_images.classes),
        folder,
        cfg.PRETRAIN.IMAGE_SIZE,
        cfg.PRETRAIN.IMS_PER_BATCH,
        start_iter,
        stop_iter,
        cfg.PRETRAIN.MAX_ITER,
        cfg.MODEL.DEVICE,
    )
    start = time.perf_counter()
    try:
        trainer.train(start_iter, stop_iter)
    except TargetReached:
        pass
    results = _results(cfg, folder, train_images, evaluation.latest, evaluation.reached_at, time.perf_counter() - start)
    if main_process:
        _write_outputs(model, results, output_dir)
    return results


def _results(
    cfg: CfgNode, data: str, images: ClassificationImages, val_top1: float, reached_at: int | None, seconds: float
) -> dict:
    """results.json of a run of ``cfg`` on ``images`` (in the folder ``data``) that reached PRETRAIN.STOP_TOP1
    after ``reached_at`` iterations (None: trained its whole schedule)."""
    results = {
        "val_top1": val_top1,
        "classes": len(images.classes),
        "data": data,
        "depth": cfg.MODEL.RESNETS.DEPTH,
        "norm": pretrained_norm(cfg),
        "iterations": reached_at or trained_iterations(cfg),
        "schedule_iterations": cfg.PRETRAIN.MAX_ITER,
        "ims_per_batch": cfg.PRETRAIN.IMS_PER_BATCH,
        "processes": comm.get_world_size(),
        "threads": torch.get_num_threads(),  # on the CPU a run repeats bit for bit only at the same count
        "device": cfg.MODEL.DEVICE,
        "train_seconds": round(seconds, 1),
        "input_convention": input_convention(cfg)._asdict(),
    }
    if cfg.PRETRAIN.STOP_TOP1:  # reached: stopped there; else trained to the end of its schedule
        results.update(stop_top1=cfg.PRETRAIN.STOP_TOP1, stop_top1_reached=reached_at is not None)
    return results


def _write_outputs(model: BackboneClassifier, results: dict, output_dir: str) -> None:
    write_checkpoint(backbone_state(model), os.path.join(output_dir, BACKBONE_FILE), author="sn_detection pretraining")
    with open(os.path.join(output_dir, RESULTS_FILE), "w") as f:
        json.dump(results, f, indent=2)


def keeps_evaluated_models(cfg: CfgNode) -> bool:
    """Whether a run of ``cfg`` keeps its model at each periodic evaluation: with
    PRETRAIN.KEEP_EVALUATED_MODELS, unless it stops at a top-1 itself (nothing is made from such a run)."""
    return cfg.PRETRAIN.KEEP_EVALUATED_MODELS and not cfg.PRETRAIN.STOP_TOP1


def save_evaluated_model(model: torch.nn.Module, run_folder: str, iterations: int) -> None:
    """The classifier's state (weights and moving averages) after ``iterations``, as ``stop_at_evaluation``
    reads it: written whole or not at all (a run killed while writing it writes it again when resumed with
    the same settings; ``cached_backbone`` leaves out a partial file)."""
    path = evaluated_model_path(run_folder, iterations)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    module = model.module if isinstance(model, DistributedDataParallel) else model
    torch.save({"model": module.state_dict(), "iterations": iterations}, path + ".tmp")
    os.replace(path + ".tmp", path)


def evaluated_model_path(run_folder: str, iterations: int) -> str:
    """Where a run's output or cache folder keeps its model after ``iterations`` (``save_evaluated_model``)."""
    return os.path.join(run_folder, EVALUATED_FOLDER, f"model_after_{iterations:07d}.pth")


def stop_at_evaluation(cfg: CfgNode, evaluated_model: str, output_dir: str, threads: int) -> dict:
    """What ``pretrain(cfg)`` ends with where PRETRAIN.STOP_TOP1 stopped it, made from the model saved at
    that evaluation by the same run without the stop (PRETRAIN.KEEP_EVALUATED_MODELS): the batch average
    and the final evaluation, as in ``pretrain``, and its backbone.pth and results.json in ``output_dir``.
    One process, on ``threads`` intra-op threads (those the run trained on: on the CPU the batch average
    sums alike only at the same count). Returns the results."""
    own_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _stop_at_evaluation(cfg, evaluated_model, output_dir)
    finally:
        torch.set_num_threads(own_threads)


def _stop_at_evaluation(cfg: CfgNode, evaluated_model: str, output_dir: str) -> dict:
    began = time.perf_counter()
    folder, train_images, val_images = _splits(cfg)
    model = BackboneClassifier(cfg, len(train_images.classes)).to(cfg.MODEL.DEVICE)
    saved = torch.load(evaluated_model, map_location=cfg.MODEL.DEVICE)
    model.load_state_dict(saved["model"])
    model.train()  # as the trainer leaves it
    batches = cfg.PRETRAIN.BATCH_AVERAGE_BATCHES
    average = (
        batch_average_hook(
            model, lambda start: train_loader(cfg, train_images, cfg.PRETRAIN.MAX_ITER + start), batches, period=0
        )
        if batches
        else None
    )
    if average is not None:
        average.update()
    val_top1 = top1(cfg, model, val_images)
    logger.info("Top-1 on the val split (%d images): %.2f %%", len(val_images), val_top1)
    results = _results(cfg, folder, train_images, val_top1, saved["iterations"], time.perf_counter() - began)
    _write_outputs(model, results, output_dir)
    return results


def report(folder: str) -> None:
    """Logs what the backbone in ``folder`` is, its top-1, and the input convention a detection config must
    use (from its results file): by the callers of ``pretrain``, which know where the backbone stays."""
    with open(os.path.join(folder, RESULTS_FILE)) as f:
        results = json.load(f)
    path = os.path.join(folder, BACKBONE_FILE)
    overrides = InputConvention(**results["input_convention"]).config_overrides()
    logger.info(
        "Pretrained ResNet-%d (%s): top-1 %.2f %% on the val split; backbone in %s. A detection config loads it "
        "with MODEL.WEIGHTS %s and this input convention: %s",
        results["depth"],
        results["norm"],
        results["val_top1"],
        path,
        path,
        " ".join(map(str, overrides)),
    )
