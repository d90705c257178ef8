"""The plan of a norm comparison: its settings, the runs (a setting and a seed, the exact train_net arguments and
a folder each), the backbones of ``--finetune`` and their folders, checked before anything runs, and what it is
about to do with an estimate of its wall time (``print_plan``)."""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from detectron2.config import CfgNode

from ... import model_zoo
from ...d2 import norm_layer, valid_norm_names
from ...engine.trainer import RESULTS_FILE
from ...layers import has_batch_statistics
from ...pretraining.cache import cached_backbone_folder, cached_backbone_path, is_cached, pretrained_root, same_run_stop
from ...pretraining.model import PRETRAINED_AS, pretrained_norm
from ...pretraining.train import METRICS_FILE, trained_iterations
from ..backbones import with_pretrain_overrides
from ..jobs import WORK_FOLDER, checkpointed_iterations, seconds_per_iteration
from ..labels import format_duration
from .runs import is_finished, read_record, read_result

# train_net from the package that runs the sweep (whose root goes first on the runs' import path)
TRAIN_NET = ("-m", "sn_detection.engine.train_net")
DEFAULT_CONFIG = os.path.join(model_zoo.CONFIG_DIR, "demo_compare_norms.yaml")
DEFAULT_SETTINGS = ("BN", "GN", "SN", "DN", "MGN", "SN/GN", "GN/SN")
# from one pretrained with its own norm (FrozenBN: from BN)
FINETUNE_SETTINGS = ("FrozenBN/-", "FrozenBN/GN", "FrozenBN/SN", "GN", "GN/SN", "SN", "DN", "MGN")
DEFAULT_FINETUNE_CONFIG = os.path.join(model_zoo.CONFIG_DIR, "demo_finetune_norms.yaml")
NO_NORM = "-"
BACKBONE_WORK_FOLDER = "backbones"  # in the output folder: backbones being pretrained, until cached
HEAD_NORM_KEYS = ("MODEL.FPN.NORM", "MODEL.ROI_BOX_HEAD.NORM", "MODEL.ROI_MASK_HEAD.NORM")


@dataclass(frozen=True)
class Setting:
    """The norm of the backbone and the norm of the FPN and both RoI heads (``-``: none)."""

    backbone: str
    head: str

    @property
    def name(self) -> str:
        return self.backbone if self.backbone == self.head else f"{self.backbone}/{self.head}"

    @property
    def folder_name(self) -> str:
        return self.name.replace("/", "-")

    def norm_overrides(self) -> list[str]:
        overrides = ["MODEL.RESNETS.NORM", _config_value(self.backbone)]
        for key in HEAD_NORM_KEYS:
            overrides += [key, _config_value(self.head)]
        return overrides


def _config_value(norm: str) -> str:
    return "" if norm == NO_NORM else norm


def parse_setting(text: str) -> Setting:
    """``NORM`` (everywhere) or ``BACKBONE/HEAD``, with names of ``valid_norm_names()`` or ``-`` (none)."""
    parts = text.split("/")
    valid = (*valid_norm_names(), NO_NORM)
    if len(parts) > 2 or any(part not in valid for part in parts):
        raise ValueError(f"setting {text!r}: expected NORM or BACKBONE/HEAD with norms from {list(valid)}")
    return Setting(parts[0], parts[-1])


def check_finetune_settings(settings: Sequence[Setting]) -> None:
    """Finetuning starts from a backbone pretrained with its own norm: a backbone without one has none."""
    for setting in settings:
        if setting.backbone == NO_NORM:
            raise ValueError(
                f"--finetune: setting {setting.name!r} has no backbone norm, and finetuning starts from a backbone "
                f"pretrained with its norm; give the backbone one of {list(valid_norm_names())}"
            )


@dataclass(frozen=True)
class RunSpec:
    """One planned run: a setting, a seed, and the exact train_net arguments."""

    setting: Setting
    seed: int
    iterations: int
    batch_average: int  # batches of the batch average; 0: none
    folder: str
    train_args: tuple[str, ...]  # --config-file FILE and KEY VALUE overrides, OUTPUT_DIR last

    def command(self) -> list[str]:
        return [sys.executable, *TRAIN_NET, "--resume", *self.train_args]

    def new_record(self) -> dict:
        return {
            "setting": self.setting.name,
            "backbone": self.setting.backbone,
            "head": self.setting.head,
            "seed": self.seed,
            "iterations": self.iterations,
            "batch_average": self.batch_average,
            "train_args": list(self.train_args),
            "attempts": [],
        }


def scaled_schedule(cfg, iterations: int) -> list[str]:
    """Overrides for a ``iterations``-long version of cfg's schedule: LR steps and warm-up scaled by
    iterations / MAX_ITER (steps that would fall on or after the end are dropped)."""
    if iterations < 1:
        raise ValueError(f"the number of iterations must be >= 1, got {iterations}")
    factor = iterations / cfg.SOLVER.MAX_ITER
    steps = sorted({round(step * factor) for step in cfg.SOLVER.STEPS} & set(range(1, iterations)))
    return [
        "SOLVER.MAX_ITER", str(iterations),
        "SOLVER.STEPS", str(tuple(steps)),
        "SOLVER.WARMUP_ITERS", str(round(cfg.SOLVER.WARMUP_ITERS * factor)),
    ]  # fmt: skip


def has_batch_statistics_norm(cfg, norm: str) -> bool:
    """Whether a ``norm`` layer built with cfg's options has batch-dependent test statistics."""
    layer = norm_layer(cfg, _config_value(norm), 64)
    return layer is not None and has_batch_statistics(layer)


def pretraining_configs(cfg, settings: Sequence[Setting], best: dict[str, dict] | None = None) -> dict[str, CfgNode]:
    """Backbone norm -> the config that pretrains it with that norm (FrozenBN: with BN) by cfg's PRETRAIN
    settings (``sn_detection.pretraining.cache.cached_backbone``), with ``best[pretrained norm]``'s PRETRAIN
    overrides (``--backbones``: tools/pretrain_grid.py's best.json) if given."""
    configs = {}
    for norm in dict.fromkeys(setting.backbone for setting in settings):
        overrides = {}
        if best is not None:
            pretrained = PRETRAINED_AS.get(norm, norm)
            if pretrained not in best:
                raise ValueError(
                    f"--backbones: no pretraining setting for {pretrained}"
                    f"{f' (the backbone of {norm})' if pretrained != norm else ''}; it has {sorted(best)}"
                )
            overrides = best[pretrained]
        configs[norm] = with_pretrain_overrides(cfg, norm, overrides)
    return configs


def read_backbone_settings(path: str) -> dict[str, dict]:
    """``--backbones FILE``: {pretrained norm: {PRETRAIN key: value}}, as tools/pretrain_grid.py writes
    its best.json."""
    try:
        with open(path) as f:
            best = json.load(f)
    except OSError as error:
        raise ValueError(f"--backbones {path}: {error.strerror}") from None
    except ValueError as error:
        raise ValueError(f"--backbones {path}: not JSON ({error})") from None
    if not isinstance(best, dict) or not all(isinstance(v, dict) for v in best.values()):
        raise ValueError(
            f"--backbones {path}: expected {{norm: {{PRETRAIN key: value}}}}, as pretrain_grid's best.json"
        )
    if not best:
        raise ValueError(f"--backbones {path} names no norm: is the pretraining grid done for any norm?")
    return best


def plan_runs(
    cfg,
    config_file: str,
    settings: Sequence[Setting],
    seeds: Sequence[int],
    output_dir: str,
    iterations: int | None = None,
    batch_average_batches: int | None = None,
    opts: Sequence[str] = (),
    backbones: dict[tuple[str, int], str] | None = None,
) -> list[RunSpec]:
    """The runs of the sweep, seeds outermost. ``cfg`` is ``config_file`` with ``opts`` (KEY VALUE), which
    apply to every run; the sweep's own keys (norms, batch average, seed, schedule, and the initial weights
    ``backbones[backbone norm, seed]`` when finetuning) come after them and win."""
    if len(set(settings)) != len(settings) or len(set(seeds)) != len(seeds):
        raise ValueError(f"settings and seeds must not repeat: {[s.name for s in settings]}, {list(seeds)}")
    if any(seed < 0 for seed in seeds):
        raise ValueError(f"seeds must be >= 0 (detectron2 draws a random seed for a negative one), got {list(seeds)}")
    if batch_average_batches is not None and batch_average_batches < 0:
        raise ValueError(f"the number of batch-average batches must be >= 0, got {batch_average_batches}")
    config_file = os.path.abspath(config_file)
    schedule = scaled_schedule(cfg, iterations) if iterations is not None else []
    num_batches = cfg.TEST.BATCH_AVERAGE.NUM_BATCHES if batch_average_batches is None else batch_average_batches
    runs = []
    # seeds outermost: a sweep cut short has compared every setting on its first seeds
    for seed in seeds:
        for setting in settings:
            batch_stats = any(has_batch_statistics_norm(cfg, norm) for norm in (setting.backbone, setting.head))
            batch_average = num_batches if batch_stats else 0
            average = ["TEST.BATCH_AVERAGE.ENABLED", str(batch_average > 0)]
            if batch_average:
                average += ["TEST.BATCH_AVERAGE.NUM_BATCHES", str(batch_average)]
            folder = os.path.abspath(os.path.join(output_dir, setting.folder_name, f"seed{seed}"))
            weights = ["MODEL.WEIGHTS", backbones[setting.backbone, seed]] if backbones else []
            overrides = [*opts, *setting.norm_overrides(), *weights, *average, "SEED", str(seed), *schedule]
            runs.append(
                RunSpec(
                    setting=setting,
                    seed=seed,
                    iterations=iterations or cfg.SOLVER.MAX_ITER,
                    batch_average=batch_average,
                    folder=folder,
                    train_args=("--config-file", config_file, *overrides, "OUTPUT_DIR", folder),
                )
            )
    return runs


def check_folders(runs: Sequence[RunSpec]) -> None:
    """Fail before anything runs if a run's folder holds something other than that run."""
    for run in runs:
        record = read_record(run.folder)
        if record is None:
            if os.path.isdir(run.folder) and os.listdir(run.folder):
                raise ValueError(f"{run.folder} is not empty and was not made by this sweep: use another --output-dir")
        elif record["train_args"] != list(run.train_args):
            raise ValueError(
                f"{run.folder} holds a run with other train_net arguments than planned:\n  "
                f"{' '.join(record['train_args'])}\ninstead of\n  {' '.join(run.train_args)}\n"
                "use another --output-dir, or remove that folder to run it again"
            )


def backbones_to_make(configs: dict[tuple[str, int], CfgNode]) -> list[CfgNode]:
    """The pretraining configs of ``backbone_configs`` whose backbone is not in the cache, each once."""
    missing = {}
    for config in configs.values():
        if not is_cached(config):
            missing.setdefault(cached_backbone_path(config), config)
    return list(missing.values())


def backbone_job_folder(output_dir: str, config: CfgNode) -> str:
    """Where the sweep in ``output_dir`` pretrains the backbone of ``config`` until it is cached."""
    return os.path.join(output_dir, BACKBONE_WORK_FOLDER, os.path.basename(cached_backbone_folder(config)))


def cached_seconds_per_iteration(config: CfgNode) -> tuple[float, int]:
    """(median pretraining seconds per iteration, how many backbones it is the median of) over the cached
    backbones of ``config``'s depth and pretrained norm (each its metrics.json's median); NaN and 0 if
    there is none."""
    name = f"resnet{config.MODEL.RESNETS.DEPTH}-{pretrained_norm(config)}-*"
    measured = [seconds_per_iteration(path) for path in glob.glob(os.path.join(pretrained_root(), name, METRICS_FILE))]
    measured = [seconds for seconds in measured if not math.isnan(seconds)]
    return (statistics.median(measured), len(measured)) if measured else (math.nan, 0)


def print_plan(
    runs: Sequence[RunSpec], pretraining: dict[tuple[str, int], CfgNode], output_dir: str, jobs: int
) -> None:
    """What the sweep is about to do and an estimate of its wall time, before it does anything: runs
    done and to run, backbones to pretrain first (a killed one's time counted from its last checkpoint in
    ``output_dir``)."""
    finished = [read_result(run.folder, RESULTS_FILE) for run in runs if is_finished(run.folder, RESULTS_FILE)]
    todo = len(runs) - len(finished)
    settings, seeds = len({run.setting for run in runs}), len({run.seed for run in runs})
    iterations = ", ".join(str(i) for i in sorted({run.iterations for run in runs}))
    print(
        f"Sweep: {settings} setting(s) x {seeds} seed(s) = {len(runs)} runs of {iterations} iterations; "
        f"{len(finished)} done, {todo} to run, --jobs {jobs}.",
        flush=True,
    )
    missing = backbones_to_make(pretraining)
    if missing:
        print(
            f"First {len(missing)} backbone(s) not in the cache are pretrained, {min(jobs, len(missing))} at a time:",
            flush=True,
        )
        for config in missing:
            norm, steps = pretrained_norm(config), trained_iterations(config)
            same_run = same_run_stop(config)
            if same_run is not None:
                how = (
                    f"top-1 {config.PRETRAIN.STOP_TOP1:g} % first reached after {same_run[1]} iterations"
                    if same_run[1]
                    else f"top-1 {config.PRETRAIN.STOP_TOP1:g} % not reached before its end: a copy"
                )
                print(
                    f"  {norm}, SEED {config.SEED}: made without training from the cached run it cuts short "
                    f"({how}): {same_run[0]}",
                    flush=True,
                )
                continue
            done = checkpointed_iterations(os.path.join(backbone_job_folder(output_dir, config), WORK_FOLDER))
            per_iter, count = cached_seconds_per_iteration(config)
            basis = (
                f"{per_iter:.2f} s/iter, the median of {count} cached {norm} backbone(s)' training time"
                if count
                else f"no cached {norm} backbone to estimate from"
            )
            resumed = f", resumed after {done} checkpointed" if done else ""
            at_most = (
                f"at most (it stops at {config.PRETRAIN.STOP_TOP1:g} % top-1) " if config.PRETRAIN.STOP_TOP1 else ""
            )
            print(
                f"  {norm}, SEED {config.SEED}, {at_most}{steps} iterations{resumed}: "
                f"{format_duration(per_iter * (steps - done))} ({basis})",
                flush=True,
            )
    if todo:
        per_run = statistics.median(result.wall_s for result in finished) if finished else math.nan
        at_once = min(jobs, todo)
        basis = (
            f"{todo} x {format_duration(per_run)}, the median wall time of the {len(finished)} finished run(s), "
            f"/ {at_once} at once"
            if finished
            else "known once a run of this sweep has finished"
        )
        print(
            f"Estimated wall time of the {todo} run(s) to run: {format_duration(todo * per_run / at_once)} ({basis}).",
            flush=True,
        )
