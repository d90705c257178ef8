"""The backbone cache: ``cached_backbone(cfg)`` pretrains once (``train.pretrain``) into a folder keyed by
everything that determines the backbone (the ResNet and norm settings, the input convention, PRETRAIN,
SEED), verified by its manifest on every use like the datasets (``sn_detection.data.cache``): the demo's
backbone, and the sweeps'. The folders are in ``$SN_DETECTION_PRETRAINED``, by default
``~/.cache/sn_detection/pretrained``.

A run with PRETRAIN.KEEP_EVALUATED_MODELS keeps its model at each periodic evaluation in its folder too
(``evaluated/``): a run stopped at a top-1 is the same run cut short, so where that run is cached it is made
from it without training (``same_run_stop``, ``top1_stop``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

from detectron2.config import CfgNode

from ..data.cache import ensure_folder, is_intact
from .model import input_convention, pretrained_norm
from .top1_stop import from_same_run, stop_in_run, without_stop
from .train import (
    BACKBONE_FILE,
    EVALUATED_FOLDER,
    METRICS_FILE,
    RESULTS_FILE,
    keeps_evaluated_models,
    pretrain,
    report,
    trained_iterations,
)

logger = logging.getLogger(__name__)

# Bump when pretraining changes what it produces, so that cached backbones are made again.
RECIPE_VERSION = 1
SPARSE_NORMS = ("SSN", "SyncSSN")
SSN_KEYS = ("SSN_GATE_LR_FACTOR", "SSN_GATE_CLIP_NORM", "SSN_RADIUS")  # PRETRAIN keys read for SSN layers only


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
    if pretrained_norm(cfg) not in SPARSE_NORMS:  # SSN's rules shape an SSN backbone only; the others keep their keys
        for key in SSN_KEYS:
            del pretrain[key]
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


def same_run_stop(cfg: CfgNode) -> tuple[str, int | None] | None:
    """Where ``cfg`` has PRETRAIN.STOP_TOP1 and the same run without the stop is cached: ``stop_in_run`` of that
    run's cache folder, (the folder, the iterations after which the run reached the top-1 there, or None where
    it never did before its end). None where ``cfg`` has no stop, the run is not cached, or ``stop_in_run``
    finds that ``cfg`` must be trained."""
    if not cfg.PRETRAIN.STOP_TOP1:
        return None
    source_cfg = without_stop(cfg)
    if not is_cached(source_cfg):
        return None
    return stop_in_run(cfg, cached_backbone_folder(source_cfg))


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
            logger.info(
                "%s: the run of %s stopped after %s iterations, made from it without training",
                os.path.basename(folder),
                same_run[0],
                same_run[1] or "all its",
            )
            from_same_run(cfg, *same_run, target)
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
