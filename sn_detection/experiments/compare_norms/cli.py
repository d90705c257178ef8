"""The command line of tools/compare_norms.py: its options, checked before anything runs, and the sweep run
in order: plan, backbones, runs, outputs (the package's docstring says what each does and why)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections.abc import Sequence

from ...engine.arguments import output_file
from ...engine.launch import load_cfg
from ...pretraining.cache import cached_backbone_path, is_cached
from ..backbones import DEFAULT_SEEDS, backbone_configs
from .plan import (
    DEFAULT_CONFIG,
    DEFAULT_FINETUNE_CONFIG,
    DEFAULT_SETTINGS,
    FINETUNE_SETTINGS,
    check_finetune_settings,
    check_folders,
    parse_setting,
    plan_runs,
    pretraining_configs,
    print_plan,
    read_backbone_settings,
)
from .publish import write_outputs
from .report import describe
from .run import make_backbones, run_sweep
from .runs import initial_weights

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = os.path.join("output", "compare_norms")
DEFAULT_FINETUNE_OUTPUT_DIR = os.path.join("output", "compare_norms_finetune")
DEFAULT_BEST_OUTPUT_DIR = os.path.join("output", "compare_norms_finetune_best")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train the same CPU-sized Mask R-CNN once per norm setting and seed and compare COCO AP."
    )
    parser.add_argument(
        "--finetune",
        action="store_true",
        help="finetune each backbone from one pretrained with its norm (the SN paper's protocol); without it, "
        "train from scratch",
    )
    parser.add_argument(
        "--config-file",
        metavar="FILE",
        help=f"the base config (default: {DEFAULT_CONFIG}; with --finetune {DEFAULT_FINETUNE_CONFIG})",
    )
    # extend: a setting that starts with '-' reads as an option unless attached (--settings=-/GN), and an
    # attached value takes no others after it, so --settings may repeat
    parser.add_argument(
        "--settings",
        nargs="+",
        action="extend",
        metavar="SETTING",
        help=f"NORM (backbone, FPN, heads) or BACKBONE/HEAD, - for none (write a setting that starts with - as "
        f"--settings=-/GN, one per --settings, which may repeat); default: {' '.join(DEFAULT_SETTINGS)}; "
        f"with --finetune {' '.join(FINETUNE_SETTINGS)}",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="default: %(default)s")
    parser.add_argument("--iters", type=int, help="iterations per run, the schedule scaled (default: the config's)")
    parser.add_argument(
        "--batch-average-batches",
        type=int,
        metavar="K",
        help="batches of the batch average for settings with batch statistics; 0: none (default: the config's)",
    )
    parser.add_argument(
        "--output-dir",
        help=f"one folder per run in it (default: {DEFAULT_OUTPUT_DIR}; with --finetune {DEFAULT_FINETUNE_OUTPUT_DIR})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="runs at once, the threads (OMP_NUM_THREADS, else the cores) split between them (default: 1)",
    )
    parser.add_argument(
        "--backbones",
        metavar="BEST_JSON",
        help="with --finetune: pretrain each backbone norm with its PRETRAIN setting in this file "
        f"(tools/pretrain_grid.py's best.json; FrozenBN: BN's); default --output-dir then {DEFAULT_BEST_OUTPUT_DIR}",
    )
    parser.add_argument(
        "--stop-top1",
        type=float,
        metavar="X",
        help="with --backbones: every backbone stops at val top-1 X (PRETRAIN.STOP_TOP1) in place of the file's, "
        "e.g. a common top-1 that every seed's backbone reaches; made without training where a cached run of "
        "the same setting kept its evaluated models",
    )
    parser.add_argument(
        "--backbone-seeds",
        action="store_true",
        help="with --finetune: seed k finetunes a backbone pretrained with SEED k, so that the spread over seeds "
        "includes the backbone's (default: every seed finetunes the backbone of the config's SEED)",
    )
    parser.add_argument(
        "--publish",
        metavar="FILE",
        type=output_file,
        help="also write the table here, e.g. model_zoo/sections/NAME.md: a section of model_zoo/README.md, which "
        "python -m sn_detection.model_zoo renders",
    )
    parser.add_argument("--report-only", action="store_true", help="only write the tables and plots of finished runs")
    parser.add_argument("--plan-only", action="store_true", help="print the plan and the estimate, run nothing")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides for every run")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config_file = args.config_file or (DEFAULT_FINETUNE_CONFIG if args.finetune else DEFAULT_CONFIG)
    default_output = DEFAULT_BEST_OUTPUT_DIR if args.backbones else DEFAULT_FINETUNE_OUTPUT_DIR
    args.output_dir = args.output_dir or (default_output if args.finetune else DEFAULT_OUTPUT_DIR)
    args.settings = args.settings or list(FINETUNE_SETTINGS if args.finetune else DEFAULT_SETTINGS)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.backbones and not args.finetune:
        parser.error("--backbones chooses the pretrained backbones of --finetune; add --finetune")
    if args.stop_top1 is not None and not args.backbones:
        parser.error("--stop-top1 replaces the PRETRAIN.STOP_TOP1 of --backbones' settings; add --backbones")
    if args.stop_top1 is not None and not 0 < args.stop_top1 <= 100:
        parser.error(f"--stop-top1 must be a top-1 in (0, 100] %, got {args.stop_top1:g}")
    if args.plan_only and args.report_only:
        parser.error("--plan-only prints what would run, --report-only writes what has run: give one")
    if args.backbone_seeds and not args.finetune:
        parser.error("--backbone-seeds seeds the pretrained backbones of --finetune; add --finetune")
    try:
        args.settings = [parse_setting(text) for text in args.settings]
        if args.finetune:
            check_finetune_settings(args.settings)
        args.backbone_settings = read_backbone_settings(args.backbones) if args.backbones else None
        if args.stop_top1 is not None:
            args.backbone_settings = {
                norm: {**overrides, "PRETRAIN.STOP_TOP1": args.stop_top1}
                for norm, overrides in args.backbone_settings.items()
            }
    except ValueError as error:
        parser.error(str(error))
    return args


def plan_sweep(args: argparse.Namespace) -> tuple:
    """The loaded config, each backbone norm's pretraining config, the backbones' configs per (norm, seed) and
    the runs, checked before any pretraining, which takes the longest; a bad value exits with its error."""
    cfg = load_cfg(os.path.abspath(args.config_file), list(args.opts))
    try:
        per_norm = pretraining_configs(cfg, args.settings, args.backbone_settings) if args.finetune else {}
        pretraining = backbone_configs(per_norm, args.seeds, args.backbone_seeds)
        backbones = {key: cached_backbone_path(config) for key, config in pretraining.items()} or None
        runs = plan_runs(
            cfg,
            args.config_file,
            args.settings,
            args.seeds,
            args.output_dir,
            args.iters,
            args.batch_average_batches,
            args.opts,
            backbones,
        )
        check_folders(runs)
    except ValueError as error:
        raise SystemExit(f"compare_norms: error: {error}") from None
    return cfg, per_norm, pretraining, runs


def warn_of_backbones_not_cached(per_norm: dict) -> None:
    """--backbones: the grid made each norm's backbone of the config's SEED; one not in the cache is made first
    (--backbone-seeds' others are new)."""
    for norm, config in per_norm.items():
        if not is_cached(config):
            logger.warning(
                "--backbones: the backbone of %s is not in the cache (%s): it is pretrained first; the "
                "grid's config and KEY VALUE overrides would have made it",
                norm,
                cached_backbone_path(config),
            )


def runs_with_backbones(args: argparse.Namespace, pretraining: dict, runs: list) -> tuple[list, list]:
    """The backbones not cached yet made; (the runs whose backbone failed, the others)."""
    failed_backbones = make_backbones(
        pretraining,
        os.path.abspath(args.output_dir),
        os.path.abspath(args.config_file),
        args.opts,
        args.backbone_settings,
        args.jobs,
    )
    missing = {cached_backbone_path(config) for config in failed_backbones}
    failed = [run for run in runs if initial_weights(run.train_args) in missing]
    if failed:
        logger.error(
            "not run, their backbone failed (its log is named above): %s",
            ", ".join(f"{run.setting.name} seed {run.seed}" for run in failed),
        )
    return failed, [run for run in runs if run not in failed]


def main(argv: Sequence[str] | None = None) -> int:
    """Returns the exit status: 1 if a run failed."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s compare_norms] %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    cfg, per_norm, pretraining, runs = plan_sweep(args)
    backbones = (args.backbones, args.backbone_settings) if args.backbone_settings else None
    description = describe(cfg, args.config_file, runs, backbones, args.backbone_seeds, args.stop_top1)
    write = functools.partial(write_outputs, runs, args.output_dir, description, args.publish)
    if args.backbone_settings:
        warn_of_backbones_not_cached(per_norm)
    if not args.report_only:
        print_plan(runs, pretraining, args.output_dir, args.jobs)
    if args.plan_only:
        return 0
    failed = []
    if not args.report_only:
        failed, runnable = runs_with_backbones(args, pretraining, runs)
        failed += run_sweep(runnable, report_after_each=write, jobs=args.jobs)
    results = write()
    logger.info("%d of %d runs finished; results in %s", len(results), len(runs), args.output_dir)
    if failed:
        logger.error("failed runs: %s", ", ".join(f"{run.setting.name} seed {run.seed}" for run in failed))
    return 1 if failed else 0
