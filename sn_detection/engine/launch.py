"""Config set-up and the main function of tools/train_net.py, kept here so the tool stays a few lines."""

from __future__ import annotations

import logging

import torch
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.config import get_cfg
from detectron2.engine import default_setup
from detectron2.utils import comm
from detectron2.utils.logger import setup_logger

from ..d2 import add_sn_config
from ..data.datasets import register_shapes_datasets
from .trainer import Trainer

logger = logging.getLogger(__name__)


def setup_cfg(args):
    """A frozen config from args.config_file and the trailing KEY VALUE overrides in args.opts."""
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.merge_from_file(args.config_file)
    cfg.merge_from_list(args.opts)
    if cfg.MODEL.DEVICE.startswith("cuda") and not torch.cuda.is_available():
        cfg.MODEL.DEVICE = "cpu"
    cfg.freeze()
    default_setup(cfg, args)
    setup_logger(output=cfg.OUTPUT_DIR, distributed_rank=comm.get_rank(), name="sn_detection")
    if cfg.MODEL.DEVICE == "cpu":
        logger.info("No CUDA device: running on the CPU.")
    return cfg


def main(args):
    register_shapes_datasets()
    cfg = setup_cfg(args)
    if args.eval_only:
        model = Trainer.build_model(cfg)
        DetectionCheckpointer(model, save_dir=cfg.OUTPUT_DIR).resume_or_load(cfg.MODEL.WEIGHTS, resume=args.resume)
        return Trainer.test(cfg, model)
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=args.resume)
    return trainer.train()
