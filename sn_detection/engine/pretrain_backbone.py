"""tools/pretrain_backbone.py: pretrain the ResNet of a detection config on image classification
(``sn_detection.pretraining``), in K processes, or make (once) and print the cached backbone of a config.

    tools/pretrain_backbone.py --config-file CFG [--num-gpus K] [--num-machines M ...] [--resume] [KEY VALUE ...]
    tools/pretrain_backbone.py --config-file CFG --cached [KEY VALUE ...]    # prints the backbone's path

The config says which ResNet (MODEL.RESNETS, our norms' MODEL.SN), the input convention (PIXEL_MEAN,
PIXEL_STD, INPUT.FORMAT, STRIDE_IN_1X1) and the pretraining (PRETRAIN.*: data, size, batch, schedule).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from detectron2.engine import default_argument_parser, default_setup
from detectron2.utils import comm
from detectron2.utils.logger import setup_logger

from ..pretraining.cache import cached_backbone
from ..pretraining.train import pretrain, report
from .launch import launch_processes, load_cfg


def pretrain_in_process(args) -> dict:
    cfg = load_cfg(args.config_file, args.opts)
    cfg.defrost()
    cfg.OUTPUT_DIR = cfg.PRETRAIN.OUTPUT_DIR  # where default_setup writes the config and the log
    cfg.freeze()
    default_setup(cfg, args)
    setup_logger(output=cfg.OUTPUT_DIR, distributed_rank=comm.get_rank(), name="sn_detection")
    results = pretrain(cfg, resume=args.resume)
    if comm.is_main_process():
        report(cfg.OUTPUT_DIR)
    return results


def build_parser() -> argparse.ArgumentParser:
    """detectron2's training arguments, and --cached."""
    parser = default_argument_parser()
    parser.add_argument(
        "--cached",
        action="store_true",
        help="make the config's backbone once, in one process, in the cache; print its path (stdout)",
    )
    return parser


def main(argv: Sequence[str] | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.eval_only:
        parser.error("--eval-only: pretraining has no evaluation-only run; its top-1 is in results.json")
    if args.cached and (args.resume or args.num_gpus > 1 or args.num_machines > 1):
        parser.error(
            "--cached makes the backbone from the start in one process; --resume, --num-gpus and "
            "--num-machines are for a pretraining run into PRETRAIN.OUTPUT_DIR"
        )
    if args.cached:
        setup_logger(name="detectron2")
        setup_logger(name="sn_detection")
        path = cached_backbone(load_cfg(args.config_file, args.opts))
        print(path)
        return path
    return launch_processes(pretrain_in_process, args)
