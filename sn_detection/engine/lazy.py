"""tools/lazyconfig_train_net.py: training and COCO evaluation from a LazyConfig (a ``.py`` config in the
manner of detectron2's ``configs/new_baselines``; ours are in ``configs/lazy``), with the batch-average and
norm-analysis hooks.

The config's ``model``, ``dataloader`` (``train``, ``test``, ``evaluator``), ``optimizer``,
``lr_multiplier`` and ``train`` are detectron2's usual keys; ``train`` may add

    batch_average = dict(enabled=..., num_batches=...)   the SN paper's batch average before each
                                                         evaluation and after training
    norm_analysis_period = N                             log what the learned norms chose every N
                                                         iterations (0: off)
    ssn_radius = (start, end)                            SSN's radius before the first iteration and after
                                                         the last, linear in between (default (0, 1))
    graphed_backbone = dict(enabled=..., max_graphs=..., run the backbone and FPN as CUDA graphs, one per
                            warmup=...)                  input shape (``d2.graphed_backbone``; CUDA only)

Our norms come as ``NormFactory`` objects with their options as plain arguments, so
``LazyConfig.load`` + ``instantiate`` builds the model the file describes, with no ``MODEL.SN`` involved.
As in detectron2's own lazy trainer, a resumed run restarts the data stream (the exact resume of
``tools/train_net.py`` needs its yaml configs), and ``init_checkpoint`` is loaded with our checked
checkpointer. The latest evaluation goes to ``output_dir/eval_results.json``, as with train_net.
"""

from __future__ import annotations

import argparse
import copy
import logging
from collections.abc import Sequence

from detectron2.config import LazyConfig, instantiate
from detectron2.engine import default_argument_parser, default_setup, default_writers, hooks
from detectron2.evaluation import inference_on_dataset, print_csv_format
from detectron2.utils import comm
from detectron2.utils.logger import setup_logger

from ..d2 import CheckedCheckpointer, ddp_model, fold_norms, share_first_process_buffers, step_trainer
from ..d2.checkpointer import check_resumed_iteration
from ..d2.graphed_backbone import GraphedBackbone, graph_backbone
from ..d2.hooks import batch_average_hook, insert_before_evaluation, radius_hook
from ..d2.norm_analysis import norm_analysis_hook
from ..data.datasets import register_shapes_datasets
from ..layers.options import POSITIVE_INT, RADIUS_RANGE
from .arguments import add_fold_argument
from .launch import launch_processes
from .trainer import write_results

logger = logging.getLogger(__name__)


def evaluate(cfg, model) -> dict:
    """COCO evaluation of ``model`` on ``dataloader.test`` with ``dataloader.evaluator``; written to
    ``train.output_dir/eval_results.json``."""
    if "evaluator" not in cfg.dataloader:
        return {}
    share_first_process_buffers(model)  # the statistics the checkpoint holds, in every process
    results = inference_on_dataset(model, instantiate(cfg.dataloader.test), instantiate(cfg.dataloader.evaluator))
    print_csv_format(results)
    if comm.is_main_process():
        write_results(cfg.train.output_dir, {cfg.dataloader.test.dataset.names: results})
    return results


def batch_average_batches(train) -> int:
    """The batches of ``train.batch_average`` (0: off), checked before training: a misspelt key would
    otherwise turn the batch average off without a word."""
    averaging = train.get("batch_average", {})
    unknown = sorted(set(averaging) - {"enabled", "num_batches"})
    if unknown:
        raise ValueError(f"train.batch_average has unknown keys {unknown}: its keys are 'enabled' and 'num_batches'")
    if not averaging.get("enabled", False):
        return 0
    num_batches = averaging.get("num_batches")
    if not POSITIVE_INT.holds(num_batches):
        raise ValueError(
            f"train.batch_average.num_batches={num_batches!r} is invalid: it must be an int >= 1 "
            "when the batch average is enabled"
        )
    return num_batches


def ssn_radius(train) -> tuple[float, float]:
    """``train.ssn_radius`` (start, end), (0, 1) when absent, checked."""
    radius = tuple(train.get("ssn_radius", (0.0, 1.0)))
    if not RADIUS_RANGE.holds(radius):
        raise ValueError(f"train.ssn_radius={radius!r} is invalid: it must be {RADIUS_RANGE.text}")
    return radius


def graphed_backbone_options(train) -> dict | None:
    """The options of ``GraphedBackbone`` that ``train.graphed_backbone`` sets (None: off), checked before
    anything is built: graphs need CUDA."""
    graphing = dict(train.get("graphed_backbone", {}))
    rules = GraphedBackbone.option_rules
    unknown = sorted(set(graphing) - {"enabled", *rules})
    if unknown:
        raise ValueError(f"train.graphed_backbone has unknown keys {unknown}: its keys are {['enabled', *rules]}")
    if not graphing.pop("enabled", False):
        return None
    if not str(train.device).startswith("cuda"):
        raise ValueError(
            f"train.graphed_backbone.enabled=True needs CUDA graphs, but train.device={train.device!r}; set "
            "train.graphed_backbone.enabled=False to run the backbone eagerly"
        )
    for key, value in graphing.items():
        if not rules[key].holds(value):
            raise ValueError(f"train.graphed_backbone.{key}={value!r} is invalid: it must be {rules[key].text}")
    return graphing


def built_model(cfg, graphing: dict | None):
    """``cfg.model`` on ``train.device``, its backbone graphed with the options ``graphing`` (None: not)."""
    model = instantiate(cfg.model)
    model.to(cfg.train.device)
    return model if graphing is None else graph_backbone(model, **graphing)


def training_hooks(cfg, model, checkpointer, num_batches: int) -> list:
    """detectron2's lazy-trainer hooks, with the batch average of ``num_batches`` (0: none) before
    checkpointing and evaluation and the norm analysis before the writers."""
    main_process = comm.is_main_process()
    base = [
        radius_hook(model, cfg.train.max_iter, *ssn_radius(cfg.train)),
        hooks.IterationTimer(),
        hooks.LRScheduler(scheduler=instantiate(cfg.lr_multiplier)),
        hooks.PeriodicCheckpointer(checkpointer, **cfg.train.checkpointer) if main_process else None,
        hooks.EvalHook(cfg.train.eval_period, lambda: evaluate(cfg, model)),
    ]
    if num_batches:
        loader_cfg = copy.deepcopy(cfg.dataloader.train)
        loader_cfg.num_workers = 0  # as DefaultTrainer does for PreciseBN
        # a fresh loader: the lazy trainer's streams restart on resume
        average = batch_average_hook(model, lambda _: instantiate(loader_cfg), num_batches, cfg.train.eval_period)
        base = insert_before_evaluation(base, average)
    analysis = norm_analysis_hook(model, cfg.train.get("norm_analysis_period", 0), cfg.train.output_dir)
    base = insert_before_evaluation(base, analysis)
    if main_process:
        base.append(
            hooks.PeriodicWriter(default_writers(cfg.train.output_dir, cfg.train.max_iter), cfg.train.log_period)
        )
    return [hook for hook in base if hook is not None]


def train(cfg, resume: bool) -> None:
    """Train ``cfg`` with detectron2's lazy trainer, our hooks and checkpointer; the EvalHook evaluates
    after the last iteration."""
    num_batches = batch_average_batches(cfg.train)  # checked before anything is built
    ssn_radius(cfg.train)
    model = built_model(cfg, graphed_backbone_options(cfg.train))
    logger.info("Model:\n%s", model)
    cfg.optimizer.params.model = model
    optimizer = instantiate(cfg.optimizer)
    loader = instantiate(cfg.dataloader.train)
    trainer = step_trainer(model, loader, optimizer, cfg.train.amp.enabled, "train.amp.enabled", **cfg.train.ddp)
    model = trainer.model
    checkpointer = CheckedCheckpointer(model, cfg.train.output_dir, trainer=trainer)
    trainer.register_hooks(training_hooks(cfg, model, checkpointer, num_batches))
    checkpointer.resume_or_load(cfg.train.init_checkpoint, resume=resume)
    # the checkpoint stores the iteration that finished: go on with the next one
    start_iter = trainer.iter + 1 if resume and checkpointer.has_checkpoint() else 0
    check_resumed_iteration(start_iter, cfg.train.max_iter, "train.max_iter", cfg.train.output_dir)
    trainer.train(start_iter, cfg.train.max_iter)


def train_or_evaluate(args) -> dict | None:
    """One process of tools/lazyconfig_train_net.py; with --eval-only, returns the AP."""
    register_shapes_datasets()
    cfg = LazyConfig.apply_overrides(LazyConfig.load(args.config_file), args.opts)
    default_setup(cfg, args)
    setup_logger(output=cfg.train.output_dir, distributed_rank=comm.get_rank(), name="sn_detection")
    if args.eval_only:
        model = ddp_model(built_model(cfg, graphed_backbone_options(cfg.train)))
        CheckedCheckpointer(model).evaluate_from(cfg.train.init_checkpoint, "train.init_checkpoint")
        if args.fold:
            fold_norms(model)
        return evaluate(cfg, model)
    train(cfg, args.resume)


def build_parser() -> argparse.ArgumentParser:
    """detectron2's training arguments: the config, --eval-only, --resume, the processes, key=value overrides;
    and --fold."""
    return add_fold_argument(default_argument_parser())


def main(argv: Sequence[str] | None = None):
    """Parse detectron2's training arguments (overrides as key=value) and run in K processes."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fold and not args.eval_only:
        parser.error("--fold goes with --eval-only: a model whose norms are folded cannot train")
    return launch_processes(train_or_evaluate, args)
