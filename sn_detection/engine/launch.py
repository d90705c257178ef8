"""Config set-up, the per-process function of tools/train_net.py (``train_net``), and the start of a
tool's processes."""

from __future__ import annotations

import logging

import torch
from detectron2.config import get_cfg
from detectron2.engine import default_setup, launch
from detectron2.utils import comm
from detectron2.utils.logger import setup_logger

from ..d2 import CheckedCheckpointer, add_sn_config, fold_norms, validate_sn_config
from ..data.datasets import check_datasets, register_shapes_datasets
from ..pretraining.config import add_pretrain_config, validate_pretrain_config
from .trainer import Trainer

logger = logging.getLogger(__name__)


def load_cfg(config_file: str, opts: list):
    """A frozen config from ``config_file`` and the KEY VALUE overrides ``opts``, with every key of
    sn_detection (d2's and pretraining's ``PRETRAIN``), on the CPU if there is no CUDA device; a bad value
    of those keys fails here, before anything is written."""
    cfg = get_cfg()
    add_sn_config(cfg)
    add_pretrain_config(cfg)
    cfg.merge_from_file(config_file)
    cfg.merge_from_list(opts)
    validate_sn_config(cfg)
    validate_pretrain_config(cfg)
    if cfg.MODEL.DEVICE.startswith("cuda") and not torch.cuda.is_available():
        cfg.MODEL.DEVICE = "cpu"
    cfg.freeze()
    return cfg


def launch_processes(function, args):
    """``function(args)`` in each process that detectron2's arguments ask for (--num-gpus, --num-machines,
    --machine-rank, --dist-url). Where torch sees CUDA devices, each process takes one, so --num-gpus K needs
    K of them; K processes on the CPU need the GPUs hidden (CUDA_VISIBLE_DEVICES=)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < visible < args.num_gpus:
        raise SystemExit(
            f"--num-gpus {args.num_gpus}: torch sees {visible} CUDA device(s) here, and each process takes one. "
            f"Ask for at most {visible}, or run the {args.num_gpus} processes on the CPU with the GPUs hidden: "
            "CUDA_VISIBLE_DEVICES= in front of the command"
        )
    return launch(
        function,
        args.num_gpus,
        num_machines=args.num_machines,
        machine_rank=args.machine_rank,
        dist_url=args.dist_url,
        args=(args,),
    )


def setup_cfg(args):
    """``load_cfg`` of args.config_file and args.opts, with detectron2's setup for training (logging,
    the config saved into OUTPUT_DIR, seeds)."""
    cfg = load_cfg(args.config_file, args.opts)
    default_setup(cfg, args)
    setup_logger(output=cfg.OUTPUT_DIR, distributed_rank=comm.get_rank(), name="sn_detection")
    if cfg.MODEL.DEVICE == "cpu":
        logger.info("No CUDA device: running on the CPU.")
    return cfg


def train_or_evaluate(args):
    """Train (and evaluate) the config of ``args``, or only evaluate with --eval-only; in each process."""
    register_shapes_datasets()
    cfg = setup_cfg(args)
    check_datasets(cfg.DATASETS.TEST if args.eval_only else [*cfg.DATASETS.TRAIN, *cfg.DATASETS.TEST])
    if args.eval_only:
        model = Trainer.build_model(cfg)
        checkpointer = CheckedCheckpointer(model, save_dir=cfg.OUTPUT_DIR)
        if args.resume and checkpointer.has_checkpoint():
            checkpointer.evaluate_from(checkpointer.get_checkpoint_file(), f"the last checkpoint in {cfg.OUTPUT_DIR}")
        else:
            checkpointer.evaluate_from(cfg.MODEL.WEIGHTS, "MODEL.WEIGHTS")
        if args.fold:
            fold_norms(model)
        return Trainer.test(cfg, model)
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=args.resume)
    return trainer.train()
