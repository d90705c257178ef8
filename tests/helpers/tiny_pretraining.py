"""The config of the pretraining tests: the R18-FPN Mask R-CNN of configs/demo_compare_norms.yaml with
SN, pretrained a few iterations on a tiny classification set at 32 px; the PRETRAIN keys of the tools'
tiny pretrainings; a pretraining killed mid-way, as a killed job leaves it; evaluations of a scripted top-1;
a backbone file's tensors."""

import os

import pytest
import torch
from detectron2.config import get_cfg

from sn_detection.d2 import add_sn_config, trainers
from sn_detection.pretraining import train as pretraining_train
from sn_detection.pretraining.config import add_pretrain_config
from sn_detection.pretraining.train import pretrain

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "demo_compare_norms.yaml")


def tiny_pretraining(data, output_dir, *opts):
    return [
        "MODEL.RESNETS.NORM",
        "SN",
        "MODEL.FPN.NORM",
        "SN",
        "MODEL.ROI_BOX_HEAD.NORM",
        "SN",
        "MODEL.ROI_MASK_HEAD.NORM",
        "SN",
        "PRETRAIN.DATA",
        str(data),
        "PRETRAIN.IMAGE_SIZE",
        "32",
        "PRETRAIN.IMS_PER_BATCH",
        "4",
        "PRETRAIN.MAX_ITER",
        "4",
        "PRETRAIN.WARMUP_ITERS",
        "2",
        "PRETRAIN.NUM_WORKERS",
        "0",
        "PRETRAIN.CHECKPOINT_PERIOD",
        "2",
        "PRETRAIN.OUTPUT_DIR",
        str(output_dir),
        "PRETRAIN.BATCH_AVERAGE_BATCHES",
        "2",
        "SEED",
        "1",
        *opts,
    ]


def tiny_pretrain_keys(data):
    """PRETRAIN KEY VALUE arguments of 3 iterations at batch 4 on ``data``, checkpointed every iteration
    (the grid's and the finetune sweep's backbones in their tests)."""
    return [
        "PRETRAIN.DATA", str(data), "PRETRAIN.IMAGE_SIZE", "32", "PRETRAIN.IMS_PER_BATCH", "4",
        "PRETRAIN.MAX_ITER", "3", "PRETRAIN.WARMUP_ITERS", "1", "PRETRAIN.NUM_WORKERS", "0",
        "PRETRAIN.CHECKPOINT_PERIOD", "1", "PRETRAIN.BATCH_AVERAGE_BATCHES", "1",
    ]  # fmt: skip


class Interrupted(Exception):
    """What a pretraining killed by ``pretrain_killed_at`` raises."""


def pretrain_killed_at(monkeypatch, cfg, iteration, **pretrain_options):
    """``pretrain(cfg, **pretrain_options)`` stopped as the step of ``iteration`` starts, as a job killed
    there leaves it (its checkpoints so far on disk)."""

    class InterruptedTrainer(trainers.SimpleTrainer):
        def run_step(self):
            if self.iter == iteration:
                raise Interrupted
            super().run_step()

    with monkeypatch.context() as patch:
        patch.setattr(trainers, "SimpleTrainer", InterruptedTrainer)
        with pytest.raises(Interrupted):
            pretrain(cfg, **pretrain_options)


def tiny_cfg(data, output_dir, *opts):
    cfg = get_cfg()
    add_sn_config(cfg)
    add_pretrain_config(cfg)
    cfg.merge_from_file(CONFIG)
    cfg.merge_from_list(tiny_pretraining(data, output_dir, *opts))
    return cfg


def scripted_top1(monkeypatch, *values):
    """Evaluations return ``values`` in turn (then the last again): where a run stops by its top-1 is the
    logic under test, not what a few tiny iterations learn. Returns the list of calls' results."""
    calls = []

    def top1(cfg, model, images):
        value = values[min(len(calls), len(values) - 1)]
        if isinstance(value, type) and issubclass(value, BaseException):
            raise value
        calls.append(value)
        return value

    monkeypatch.setattr(pretraining_train, "top1", top1)
    return calls


def backbone_tensors(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]
