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

``cached_backbone(cfg)`` pretrains once into a cache folder keyed by everything that determines the
backbone (the ResNet and norm settings, the input convention, PRETRAIN, SEED), verified by its manifest
on every use like the datasets (``sn_detection.data.cache``): the demo's backbone, and the finetuning
sweep's. The folders are in ``$SN_DETECTION_PRETRAINED``, by default ``~/.cache/sn_detection/pretrained``.
A run with PRETRAIN.KEEP_EVALUATED_MODELS keeps its model at each periodic evaluation there too
(``evaluated/``): a run stopped at a top-1 is the same run cut short, so it is made from the kept model
of the evaluation where it would stop, by the batch average alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
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
from ..d2.hooks import batch_average_hook
from ..d2.optimizer import get_optimizer_params
from ..d2.trainers import share_first_process_buffers, step_trainer
from ..data.cache import ensure_folder, is_intact
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
# Bump when pretraining changes what it produces, so that cached backbones are made again.
RECIPE_VERSION = 1


def per_process_batch(cfg: CfgNode) -> int:
    world_size = comm.get_world_size()
    if cfg.PRETRAIN.IMS_PER_BATCH % world_size:
        raise ValueError(f"PRETRAIN.IMS_PER_BATCH={cfg.PRETRAIN.IMS_PER_BATCH} is not divisible by the {world_size} processes")
    return cfg.PRETRAIN.IMS_PER_BATCH // world_size


def build_optimizer(cfg: CfgNode, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = get_optimizer_params(
        model,
        base_lr=cfg.PRETRAIN.BASE_LR,
        weight_decay_norm=0.0,
        weight_decay_bias=0.0,
        gate_lr_factor=cfg.PRETRAIN.GATE_LR_FACTOR,
        gate_weight_decay=0.0,
    )
    return torch.optim.SGD(
        params, lr=cfg.PRETRAIN.BASE_LR, momentum=cfg.PRETRAIN.MOMENTUM, nesterov=True,
        weight_decay=cfg.PRETRAIN.WEIGHT_DECAY,
    )  # fmt: skip


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
        images, batch_size=batch, sampler=stream, num_workers=cfg.PRETRAIN.NUM_WORKERS, collate_fn=collate,
        persistent_workers=cfg.PRETRAIN.NUM_WORKERS > 0,
    )  # fmt: skip


@torch.no_grad()
def top1(cfg: CfgNode, model: torch.nn.Module, images: ClassificationImages) -> float:
    """Top-1 accuracy (%) on ``images``, each process classifying its shard."""
    module = model.module if hasattr(model, "module") else model
    training = module.training
    module.eval()
    indices = shard(len(images), comm.get_rank(), comm.get_world_size())
    loader = DataLoader(
        torch.utils.data.Subset(images, indices), batch_size=per_process_batch(cfg),
        num_workers=cfg.PRETRAIN.NUM_WORKERS, collate_fn=collate,
    )  # fmt: skip
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
                logger.info("Top-1 %.2f %% reached PRETRAIN.STOP_TOP1=%g after %d iterations: training stops here",
                            self.latest, self._target, done)  # fmt: skip
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
    average = batch_average_hook(ddp, lambda start: train_loader(cfg, train_images, cfg.PRETRAIN.MAX_ITER + start),
                                 batches, period=0) if batches else None  # fmt: skip
    trainer.register_hooks([
        hooks.IterationTimer(),
        hooks.LRScheduler(optimizer, schedule),
        evaluation,  # before the batch average and the checkpointer: it may make this iteration the last
        average,
        Checkpointer(checkpointer, cfg.PRETRAIN.CHECKPOINT_PERIOD) if main_process else None,
        hooks.PeriodicWriter(
            [CommonMetricPrinter(stop_iter), JSONWriter(os.path.join(output_dir, METRICS_FILE))],
            period=LOG_PERIOD,
        ) if main_process else None,
    ])  # fmt: skip
    start_iter = 0
    if resume and checkpointer.has_checkpoint():
        checkpointer.resume_or_load("", resume=True)
        start_iter = trainer.iter + 1
        check_resumed_iteration(start_iter, stop_iter, "PRETRAIN.STOP_ITER" if cfg.PRETRAIN.STOP_ITER else
                                "PRETRAIN.MAX_ITER", output_dir)  # fmt: skip
    trainer.data_loader = train_loader(cfg, train_images, start_iter)
    logger.info(
        "Pretraining %s-%d with %s norms on %d images of %d classes (%s), %d px, %d per batch, iterations %d-%d, "
        "of a %d-iteration schedule, on %s", "ResNet", cfg.MODEL.RESNETS.DEPTH, pretrained_norm(cfg),
        len(train_images), len(train_images.classes), folder, cfg.PRETRAIN.IMAGE_SIZE, cfg.PRETRAIN.IMS_PER_BATCH,
        start_iter, stop_iter, cfg.PRETRAIN.MAX_ITER, cfg.MODEL.DEVICE,
    )  # fmt: skip
    start = time.perf_counter()
    try:
        trainer.train(start_iter, stop_iter)
    except TargetReached:
        pass
    results = _results(cfg, folder, train_images, evaluation.latest, evaluation.reached_at, time.perf_counter() - start)
    if main_process:
        _write_outputs(model, results, output_dir)
    return results


def _results(cfg: CfgNode, data: str, images: ClassificationImages, val_top1: float, reached_at: int | None,
             seconds: float) -> dict:  # fmt: skip
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
    average = batch_average_hook(model, lambda start: train_loader(cfg, train_images, cfg.PRETRAIN.MAX_ITER + start),
                                 batches, period=0) if batches else None  # fmt: skip
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
        results["depth"], results["norm"], results["val_top1"], path, path, " ".join(map(str, overrides)),
    )  # fmt: skip


DEFAULT_PRETRAINED_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "sn_detection", "pretrained")


def pretrained_root() -> str:
    """Where cached backbones are kept: ``$SN_DETECTION_PRETRAINED``, else ``DEFAULT_PRETRAINED_ROOT``; as an
    absolute path, since the backbone paths made from it are recorded and compared by runs started from
    other working directories."""
    return os.path.abspath(os.environ.get("SN_DETECTION_PRETRAINED", DEFAULT_PRETRAINED_ROOT))


def cache_key(cfg: CfgNode) -> dict:
    """Everything that determines the pretrained backbone (module docstring)."""
    # where and how a run is made, not what it makes (CUDA_GRAPH: the same training, to float32 rounding)
    unkeyed = ("OUTPUT_DIR", "NUM_WORKERS", "EVAL_PERIOD", "CHECKPOINT_PERIOD", "KEEP_EVALUATED_MODELS", "CUDA_GRAPH")
    pretrain = {k: v for k, v in cfg.PRETRAIN.items() if k not in unkeyed}
    if trained_iterations(cfg) == cfg.PRETRAIN.MAX_ITER:  # the whole schedule, however it is written
        del pretrain["STOP_ITER"]
    if cfg.PRETRAIN.STOP_TOP1:  # where it stops depends on when it is evaluated
        pretrain["EVAL_PERIOD"] = cfg.PRETRAIN.EVAL_PERIOD
    else:  # the key that STOP_TOP1 0 leaves out is that of every backbone made before it existed
        del pretrain["STOP_TOP1"]
    return {
        "recipe": RECIPE_VERSION,
        "resnets": dict(cfg.MODEL.RESNETS, NORM=pretrained_norm(cfg)),  # FrozenBN's backbone is BN's
        "sn": dict(cfg.MODEL.SN),
        "input": input_convention(cfg)._asdict(),
        "pretrain": pretrain,
        "seed": cfg.SEED,
    }


def _cache_entry(cfg: CfgNode) -> tuple[str, dict]:
    """The folder of ``cfg``'s cached backbone and the key its manifest holds."""
    key = json.loads(json.dumps(cache_key(cfg), default=list))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = f"resnet{cfg.MODEL.RESNETS.DEPTH}-{pretrained_norm(cfg)}-{digest}"
    return os.path.join(pretrained_root(), name), key


def cached_backbone_path(cfg: CfgNode) -> str:
    """Where ``cached_backbone(cfg)`` keeps the backbone, made or not: a sweep plans with it before
    pretraining anything."""
    return os.path.join(_cache_entry(cfg)[0], BACKBONE_FILE)


def cached_backbone_folder(cfg: CfgNode) -> str:
    """The cache folder of ``cfg``'s backbone, made or not; its name holds the digest of the cache key."""
    return _cache_entry(cfg)[0]


def is_cached(cfg: CfgNode) -> bool:
    """Whether ``cfg``'s backbone is in the cache, complete and verified by its manifest."""
    folder, key = _cache_entry(cfg)
    return is_intact(folder, key)


def top1_curve(metrics_path: str, max_iter: int) -> list[tuple[int, float]]:
    """(iterations trained, val top-1) of each evaluation in metrics.json. detectron2 logs a periodic
    evaluation at the index of the iteration it follows (so after index + 1 iterations) and the final one
    at ``max_iter`` (the iterations trained) or its index; a resumed run appends, so an evaluation logged
    twice keeps its latest value, and so does the final one over a periodic one after the same iterations
    (PRETRAIN.STOP_TOP1's stop: the final one is after the batch average)."""
    if not os.path.isfile(metrics_path):
        return []
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by_iteration = {row["iteration"]: row["val_top1"] for row in rows if "val_top1" in row}
    trained = {(it if it >= max_iter else it + 1): top1 for it, top1 in sorted(by_iteration.items())}
    return sorted(trained.items())


def same_run_stop(cfg: CfgNode) -> tuple[str, int | None] | None:
    """Where ``cfg`` has PRETRAIN.STOP_TOP1 X and the same run without the stop is cached, evaluated at each
    of cfg's PRETRAIN.EVAL_PERIOD before its end: (that run's cache folder, the iterations after which it
    first reached X there, or None where it never did before its end, so that ``cfg`` trains that same
    run to the same end). None where that is not known, or where the run reached X at an evaluation whose
    model it did not keep (PRETRAIN.KEEP_EVALUATED_MODELS), or where the run was trained by several
    processes (``stop_at_evaluation`` is one) or on another device than cfg's MODEL.DEVICE: then ``cfg``
    must be trained."""
    target, period = cfg.PRETRAIN.STOP_TOP1, cfg.PRETRAIN.EVAL_PERIOD
    if not target:
        return None
    source_cfg = cfg.clone()
    source_cfg.defrost()
    source_cfg.PRETRAIN.STOP_TOP1 = 0.0
    if not is_cached(source_cfg):
        return None
    source, end = cached_backbone_folder(source_cfg), trained_iterations(source_cfg)
    with open(os.path.join(source, RESULTS_FILE)) as f:
        results = json.load(f)
    if results["processes"] != 1:  # its batch average was over each process's share of a batch
        return None
    curve = dict(top1_curve(os.path.join(source, METRICS_FILE), end))
    for done in range(period, end, period):
        if done not in curve:
            return None
        if curve[done] >= target:
            kept = os.path.isfile(evaluated_model_path(source, done))
            made_alike = results.get("device") == cfg.MODEL.DEVICE and "threads" in results
            return (source, done) if kept and made_alike else None
    return source, None


def _from_same_run(cfg: CfgNode, source: str, stop: int | None, folder: str) -> None:
    """Make ``cfg``'s cache entry in ``folder`` from ``same_run_stop``'s run in ``source``: a copy where it
    did not stop, else ``stop_at_evaluation`` of its model after ``stop`` iterations, on its threads, with
    its metrics.json rows up to there (the trained stopped run's top-1 curve). results.json says whose run
    it is (``same_run_as``)."""
    with open(os.path.join(source, METRICS_FILE)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(source, RESULTS_FILE)) as f:
        source_results = json.load(f)
    if stop is None:
        shutil.copy2(os.path.join(source, BACKBONE_FILE), os.path.join(folder, BACKBONE_FILE))
        results = dict(source_results, stop_top1=cfg.PRETRAIN.STOP_TOP1, stop_top1_reached=False)
    else:  # the periodic rows up to the stop, then the final evaluation's, where ``pretrain`` logs it
        rows = [row for row in rows if row["iteration"] < stop]
        results = stop_at_evaluation(cfg, evaluated_model_path(source, stop), folder, source_results["threads"])
        rows.append({"iteration": stop, "val_top1": results["val_top1"]})
    results["same_run_as"] = source
    with open(os.path.join(folder, RESULTS_FILE), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(folder, METRICS_FILE), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def cached_backbone(cfg: CfgNode, work_dir: str | None = None) -> str:
    """The backbone checkpoint of ``cfg``'s pretraining, made on first use in this process (progress in
    the log) and reused, verified, afterwards; a half-made one is never reused.

    Without ``work_dir`` it is pretrained from the start in a temporary folder. With ``work_dir`` (a stable
    folder of the caller's, for one cache key only) it is pretrained there with ``resume``: a run killed
    mid-way continues from its last checkpoint (PRETRAIN.CHECKPOINT_PERIOD) the next time; once finished
    its outputs move into the cache folder, which is renamed into place whole, and ``work_dir`` is removed.

    A config with PRETRAIN.STOP_TOP1 whose run without the stop is cached and tells where it would stop
    (``same_run_stop``) is made from that run instead, without training: a copy, or the batch average of the
    model it kept at that evaluation."""
    folder, key = _cache_entry(cfg)

    def make(target: str) -> None:
        same_run = same_run_stop(cfg)
        if same_run is not None:
            logger.info("%s: the run of %s stopped after %s iterations, made from it without training",
                        os.path.basename(folder), same_run[0], same_run[1] or "all its")  # fmt: skip
            _from_same_run(cfg, *same_run, target)
            return
        work = work_dir or os.path.join(target, "training")
        pretrain(cfg, resume=work_dir is not None, output_dir=work)
        for kept in (BACKBONE_FILE, RESULTS_FILE, METRICS_FILE):
            shutil.move(os.path.join(work, kept), os.path.join(target, kept))
        evaluated = os.path.join(work, EVALUATED_FOLDER)
        if keeps_evaluated_models(cfg) and os.path.isdir(evaluated):  # whole files only (save_evaluated_model)
            os.makedirs(os.path.join(target, EVALUATED_FOLDER))
            for name in os.listdir(evaluated):
                if name.endswith(".pth"):
                    shutil.move(os.path.join(evaluated, name), os.path.join(target, EVALUATED_FOLDER, name))
        if work_dir is None:
            shutil.rmtree(work)

    folder = ensure_folder(folder, key, make)
    if work_dir is not None:
        shutil.rmtree(work_dir, ignore_errors=True)  # its checkpoints: the backbone is in the cache now
    report(folder)
    return os.path.join(folder, BACKBONE_FILE)
