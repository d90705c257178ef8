"""``add_pretrain_config(cfg)``: the ``PRETRAIN`` keys, the image-classification pretraining of the
config's ResNet (``train``); ``validate_pretrain_config(cfg)``: their values checked up front.

The defaults are the usual ImageNet recipe: 224 px random crops, batch 256, Nesterov SGD with a warmup and
a cosine schedule, label smoothing 0.1, and the batch average of the batch statistics at the end.

A detection config carries the pretraining of its backbone (configs/demo_mask_rcnn_sn.yaml sets
``PRETRAIN`` keys), so the engine's ``load_cfg``, which every tool reads its config with, adds these keys
beside ``sn_detection.d2.add_sn_config``'s before it merges the file, and checks them; a config made by
hand calls ``add_pretrain_config(cfg)`` itself before merging such a file.
"""

from __future__ import annotations

import torch
from detectron2.config import CfgNode as CN

from ..layers.options import NON_NEGATIVE, POSITIVE_INT, RADIUS_RANGE, Rule, is_int, is_number


def add_pretrain_config(cfg: CN) -> None:
    """Add the ``PRETRAIN`` keys, with their defaults, to a detectron2 config (before merging a file)."""
    cfg.PRETRAIN = CN()
    cfg.PRETRAIN.DATA = "embedded"  # the embedded classification set, or an ImageFolder with train/ and val/
    cfg.PRETRAIN.IMAGE_SIZE = 224  # side of the network's input crops
    cfg.PRETRAIN.CROP_AREA = (0.08, 1.0)  # random crops: fraction of the image's area
    cfg.PRETRAIN.IMS_PER_BATCH = 256  # over all processes
    cfg.PRETRAIN.MAX_ITER = 500500  # 100 epochs of ImageNet-1k at batch 256
    # train the first STOP_ITER iterations of the MAX_ITER schedule only (0: all of them): the same run cut
    # short, as a backbone trained to a given top-1 is made (tools/pretrain_grid.py --equal-top1)
    cfg.PRETRAIN.STOP_ITER = 0
    # stop at the first evaluation (every EVAL_PERIOD iterations) whose val top-1 is at least this, in %
    # (0: never): a backbone trained to a given top-1, whatever its seed (tools/pretrain_grid.py --equal-top1)
    cfg.PRETRAIN.STOP_TOP1 = 0.0
    cfg.PRETRAIN.BASE_LR = 0.1
    cfg.PRETRAIN.WARMUP_ITERS = 5000
    cfg.PRETRAIN.MOMENTUM = 0.9
    cfg.PRETRAIN.WEIGHT_DECAY = 1e-4  # convolutions and the classifier; no decay on norms and gates
    cfg.PRETRAIN.GATE_LR_FACTOR = 1.0
    # SSN's logits: the SSN authors' ImageNet rules (a tenth of the learning rate, gradients clipped to a total
    # norm of 1; 0: no clip) and its radius, rising linearly over the PRETRAIN.MAX_ITER schedule
    cfg.PRETRAIN.SSN_GATE_LR_FACTOR = 0.1
    cfg.PRETRAIN.SSN_GATE_CLIP_NORM = 1.0
    cfg.PRETRAIN.SSN_RADIUS = (0.0, 1.0)
    cfg.PRETRAIN.LABEL_SMOOTHING = 0.1
    # after the last iteration, the batch-dependent statistics (BN, SN's BN branch, DN) become those of
    # this many training batches (the SN paper's batch average; 0: keep the moving averages)
    cfg.PRETRAIN.BATCH_AVERAGE_BATCHES = 50
    cfg.PRETRAIN.SYNC_NORMS = False  # SN -> SyncSN, SSN -> SyncSSN, BN -> SyncBN: batch statistics over all processes
    cfg.PRETRAIN.AMP = False
    # capture the training step (forward, backward, SGD step) in a CUDA graph after a few eager steps and
    # replay it (graphed_step): the losses of eager training to float32 rounding, without the host's cost per
    # layer; checkpoints as eager training's. Needs MODEL.DEVICE cuda and one process (several are refused).
    cfg.PRETRAIN.CUDA_GRAPH = False
    cfg.PRETRAIN.NUM_WORKERS = 4
    cfg.PRETRAIN.EVAL_PERIOD = 0  # top-1 on val every N iterations (0: at the end only)
    # keep the model at each of those evaluations (in evaluated/), so that this run stopped at a top-1
    # (PRETRAIN.STOP_TOP1) is made from it without training: ~45 MB each for the demo's ResNet-18
    cfg.PRETRAIN.KEEP_EVALUATED_MODELS = False
    cfg.PRETRAIN.CHECKPOINT_PERIOD = 5000
    cfg.PRETRAIN.OUTPUT_DIR = "output/pretrain"


def _is_area_range(value) -> bool:
    pair = isinstance(value, (tuple, list)) and len(value) == 2 and all(map(is_number, value))
    return pair and 0 < value[0] <= value[1] <= 1


_INT_AT_LEAST_0 = Rule(lambda v: is_int(v) and v >= 0, "an int >= 0")

# key of cfg.PRETRAIN -> what its value must be (SYNC_NORMS, AMP, CUDA_GRAPH and KEEP_EVALUATED_MODELS are
# booleans, which yacs keeps as such; CUDA_GRAPH True needs MODEL.DEVICE cuda, validate_pretrain_config)
PRETRAIN_KEY_RULES = {
    "DATA": Rule(lambda v: isinstance(v, str) and v != "", "'embedded' or an ImageFolder directory"),
    "IMAGE_SIZE": POSITIVE_INT,
    "CROP_AREA": Rule(_is_area_range, "(low, high) with 0 < low <= high <= 1"),
    "IMS_PER_BATCH": POSITIVE_INT,
    "MAX_ITER": POSITIVE_INT,
    "STOP_ITER": _INT_AT_LEAST_0,
    "STOP_TOP1": Rule(lambda v: is_number(v) and 0 <= v <= 100, "a top-1 in [0, 100] % (0: no stop)"),
    "BASE_LR": NON_NEGATIVE,
    "WARMUP_ITERS": _INT_AT_LEAST_0,
    "MOMENTUM": Rule(lambda v: is_number(v) and 0 < v < 1, "a number in (0, 1) (Nesterov momentum)"),
    "WEIGHT_DECAY": NON_NEGATIVE,
    "GATE_LR_FACTOR": NON_NEGATIVE,
    "SSN_GATE_LR_FACTOR": NON_NEGATIVE,
    "SSN_GATE_CLIP_NORM": NON_NEGATIVE,
    "SSN_RADIUS": RADIUS_RANGE,
    "LABEL_SMOOTHING": Rule(lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "BATCH_AVERAGE_BATCHES": _INT_AT_LEAST_0,
    "NUM_WORKERS": _INT_AT_LEAST_0,
    "EVAL_PERIOD": _INT_AT_LEAST_0,
    "CHECKPOINT_PERIOD": POSITIVE_INT,
    "OUTPUT_DIR": Rule(lambda v: isinstance(v, str) and v != "", "a folder name"),
}


def validate_pretrain_config(cfg: CN) -> None:
    """Raise a ValueError naming the key and its valid values for the first invalid ``PRETRAIN`` value."""
    if "PRETRAIN" not in cfg:
        raise ValueError(
            "the config has no PRETRAIN: call sn_detection.pretraining.config.add_pretrain_config(cfg) before "
            "merging a file"
        )
    for name, (is_valid, valid_values) in PRETRAIN_KEY_RULES.items():
        value = cfg.PRETRAIN[name]
        if not is_valid(value):
            raise ValueError(f"PRETRAIN.{name}={value!r} is invalid: it must be {valid_values}")
    if cfg.PRETRAIN.STOP_ITER > cfg.PRETRAIN.MAX_ITER:
        raise ValueError(
            f"PRETRAIN.STOP_ITER={cfg.PRETRAIN.STOP_ITER} is invalid: it must be 0 (the whole schedule) or at most "
            f"PRETRAIN.MAX_ITER={cfg.PRETRAIN.MAX_ITER}"
        )
    if cfg.PRETRAIN.CUDA_GRAPH and torch.device(cfg.MODEL.DEVICE).type != "cuda":
        raise ValueError(
            f"PRETRAIN.CUDA_GRAPH=True captures the training step in a CUDA graph, which needs MODEL.DEVICE cuda, "
            f"but it is {cfg.MODEL.DEVICE!r}; set PRETRAIN.CUDA_GRAPH False to train on {cfg.MODEL.DEVICE!r}"
        )
    if cfg.PRETRAIN.STOP_TOP1 and not cfg.PRETRAIN.EVAL_PERIOD:
        raise ValueError(
            f"PRETRAIN.STOP_TOP1={cfg.PRETRAIN.STOP_TOP1} needs PRETRAIN.EVAL_PERIOD > 0: the top-1 is known only "
            "at the evaluations, which PRETRAIN.EVAL_PERIOD 0 leaves to the end of training"
        )
