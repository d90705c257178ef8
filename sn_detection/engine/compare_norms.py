"""tools/compare_norms.py: the same CPU-sized Mask R-CNN trained from scratch once per norm setting and
seed, evaluated (COCO box and mask AP), and the results written as a table, a CSV and plots
(``sn_detection.evidence``).

Choices:

- **A subprocess of tools/train_net.py per run**, not an in-process call: every run starts from a fresh
  interpreter, so nothing carries over between runs (detectron2's catalogs, loggers and event storage,
  our norm options, allocator state, RNGs), a crash or an out-of-memory kill loses that run only, and a
  run is exactly the train_net command recorded in its folder (``sweep_run.json``), reproducible by hand.
  The price, a few seconds of start-up per run, is small next to minutes of training.
- **Runs one at a time, or ``--jobs N`` at a time** with the intra-op threads split between them
  (``OMP_NUM_THREADS``: the environment's, else the usable cores, divided by N). One run of these small
  models does not keep several cores busy (its ops are too small to split well), so on a machine with
  few cores, runs side by side on a share of the threads each finish more runs per hour.
- **Settings**: ``NORM`` puts one norm in the backbone, FPN and both heads; ``BACKBONE/HEAD`` puts
  ``HEAD`` in the FPN and the box and mask heads (the FPN is new, like the heads: the configs' rule).
- **Test statistics**: a setting with a norm that has batch-dependent test statistics (decided by the
  batch-average hook's own ``has_batch_statistics`` on a layer built with the config's options: BN, SN,
  DN, not GN or MGN) evaluates after the SN paper's batch average over ``TEST.BATCH_AVERAGE.NUM_BATCHES``
  training batches. BN gets it too (the hook recomputes torch BN's running statistics exactly), so
  that every norm with batch statistics is tested with the same estimator; detectron2's PreciseBN, the
  same idea, is not used on top.
- **Backbones** (``--finetune``): pretrained with each setting's backbone norm by the config's PRETRAIN
  keys, or with ``--backbones BEST_JSON`` by each norm's PRETRAIN overrides in that file
  (tools/pretrain_grid.py's best.json; FrozenBN takes BN's), made in the cache if not there yet before
  the runs, as the grid makes its cells (``jobs.execute_job``, ``--jobs`` at a time), each in
  ``OUTPUT_DIR/backbones/<cache folder>`` with checkpoints, so that a sweep killed there resumes the
  backbone (PRETRAIN.CHECKPOINT_PERIOD); its work folder goes once it is cached. Every
  seed finetunes the one backbone pretrained with the config's SEED, so the spread over seeds is the
  finetuning's only; with ``--backbone-seeds`` seed k finetunes a backbone pretrained with SEED k (the
  config's SEED gives the grid's cell), so that the spread includes the backbone's draw, which moves AP
  more than the finetuning seed does. Settings whose runs of a seed start from the same weights are
  also compared seed by seed (``report.within_backbone_differences``), where that draw cancels.
- **Budget**: ``--iters N`` scales the config's schedule linearly (``SOLVER.STEPS`` and
  ``WARMUP_ITERS`` by N / MAX_ITER); without it the config's schedule is used as is.
- **Resume**: each run has its own folder, ``OUTPUT_DIR/<setting>/seed<k>``; a run is finished when its
  ``eval_results.json`` exists and is then skipped. Any other started run is run again with train_net's
  ``--resume``: detectron2 continues from the folder's last checkpoint, or starts over if there is none
  (then the metrics of the abandoned attempt are removed, so the learning curve is that of one
  training). A folder whose record has other train_net arguments than planned is an error before
  anything runs: one sweep never mixes budgets or configs.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from detectron2.config import CfgNode

from .. import model_zoo
from ..d2 import norm_layer, valid_norm_names, validate_sn_config
from ..evidence import plots, report
from ..evidence.runs import (
    METRICS_FILE,
    RunResult,
    initial_weights,
    is_finished,
    loss_curve,
    read_record,
    read_result,
    write_record,
)
from ..layers import has_batch_statistics
from ..pretraining.model import PRETRAINED_AS, pretrained_norm
from ..pretraining.train import RESULTS_FILE as PRETRAINING_RESULTS_FILE
from ..pretraining.train import (
    cached_backbone_folder,
    cached_backbone_path,
    is_cached,
    pretrained_root,
    same_run_stop,
    trained_iterations,
)
from .jobs import (
    JOB_LOG,
    WORK_FOLDER,
    backbone_command,
    checkpointed_iterations,
    child_environment,
    code_version,
    execute_job,
    has_checkpoint,
    run_jobs,
    seconds_per_iteration,
    threads_of,
)
from .launch import load_cfg
from .timing import create_folder_of, format_duration, output_file
from .trainer import RESULTS_FILE

logger = logging.getLogger(__name__)

# train_net from the package that runs the sweep (whose root goes first on the runs' import path)
TRAIN_NET = ("-m", "sn_detection.engine.train_net")
DEFAULT_CONFIG = os.path.join(model_zoo.CONFIG_DIR, "demo_compare_norms.yaml")
DEFAULT_SETTINGS = ("BN", "GN", "SN", "DN", "MGN", "SN/GN", "GN/SN")
# --finetune: the SN paper's Tables 4-5 (BN† is FrozenBN, – no norm) and DN, MGN, each backbone finetuned
# from one pretrained with its own norm (FrozenBN: from BN)
FINETUNE_SETTINGS = ("FrozenBN/-", "FrozenBN/GN", "FrozenBN/SN", "GN", "GN/SN", "SN", "DN", "MGN")
DEFAULT_FINETUNE_CONFIG = os.path.join(model_zoo.CONFIG_DIR, "demo_finetune_norms.yaml")
NO_NORM = "-"
DEFAULT_SEEDS = (1, 2, 3)
BACKBONE_WORK_FOLDER = "backbones"  # in the output folder: backbones being pretrained, until cached
DEFAULT_OUTPUT_DIR = os.path.join("output", "compare_norms")
DEFAULT_FINETUNE_OUTPUT_DIR = os.path.join("output", "compare_norms_finetune")
DEFAULT_BEST_OUTPUT_DIR = os.path.join("output", "compare_norms_finetune_best")
HEAD_NORM_KEYS = ("MODEL.FPN.NORM", "MODEL.ROI_BOX_HEAD.NORM", "MODEL.ROI_MASK_HEAD.NORM")
TRAIN_LOG = "train_net.log"
# what the sweep writes into its output folder
TABLE_FILE, CSV_FILE, AP_PLOT_FILE, CURVES_FILE = "results.md", "results.csv", "ap.png", "loss_curves.png"


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


def pretraining_configs(
    cfg, settings: Sequence[Setting], best: Optional[dict[str, dict]] = None
) -> dict[str, CfgNode]:
    """Backbone norm -> the config that pretrains it with that norm (FrozenBN: with BN) by cfg's PRETRAIN
    settings (``sn_detection.pretraining.train.cached_backbone``), with ``best[pretrained norm]``'s PRETRAIN
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


def override_list(overrides: dict) -> list[str]:
    """PRETRAIN ``overrides`` (key -> value) as KEY VALUE arguments of a subprocess's config, each value
    written so that the config parses it back to the value ``with_pretrain_overrides`` merges."""
    return [item for key, value in overrides.items() for item in (key, repr(value))]


def with_pretrain_overrides(cfg, norm: str, overrides: dict) -> CfgNode:
    """``cfg`` with MODEL.RESNETS.NORM ``norm`` and the PRETRAIN ``overrides`` (key -> value): how both this
    sweep and tools/pretrain_grid.py make a pretraining config, so that their cache keys agree."""
    bad = [key for key in overrides if not str(key).startswith("PRETRAIN.")]
    if bad:
        raise ValueError(f"only PRETRAIN keys select a pretraining setting, got {bad}")
    result = cfg.clone()
    result.defrost()
    result.MODEL.RESNETS.NORM = norm
    result.merge_from_list([item for key, value in overrides.items() for item in (key, value)])
    validate_sn_config(result)
    return result


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
        raise ValueError(f"--backbones {path}: expected {{norm: {{PRETRAIN key: value}}}}, as pretrain_grid's best.json")
    if not best:
        raise ValueError(f"--backbones {path} names no norm: is the pretraining grid done for any norm?")
    return best


def backbone_configs(
    configs: dict[str, CfgNode], seeds: Sequence[int], per_seed: bool
) -> dict[tuple[str, int], CfgNode]:
    """(backbone norm, run seed) -> the config that pretrains the run's backbone: ``configs[norm]`` (of
    ``pretraining_configs``) for every seed, or with ``per_seed`` (``--backbone-seeds``) with SEED the run's
    seed, which seeds the backbone's initialisation and data order."""
    result = {}
    for norm, config in configs.items():
        for seed in seeds:
            seeded = config
            if per_seed and seed != config.SEED:
                seeded = config.clone()
                seeded.defrost()
                seeded.SEED = seed
            result[norm, seed] = seeded
    return result


def backbones_to_make(configs: dict[tuple[str, int], CfgNode]) -> list[CfgNode]:
    """The pretraining configs of ``backbone_configs`` whose backbone is not in the cache, each once."""
    missing = {}
    for config in configs.values():
        if not is_cached(config):
            missing.setdefault(cached_backbone_path(config), config)
    return list(missing.values())


def cached_seconds_per_iteration(config: CfgNode) -> tuple[float, int]:
    """(median pretraining seconds per iteration, how many backbones it is the median of) over the cached
    backbones of ``config``'s depth and pretrained norm (each its metrics.json's median); NaN and 0 if
    there is none."""
    name = f"resnet{config.MODEL.RESNETS.DEPTH}-{pretrained_norm(config)}-*"
    measured = [seconds_per_iteration(path) for path in glob.glob(os.path.join(pretrained_root(), name, METRICS_FILE))]
    measured = [seconds for seconds in measured if not math.isnan(seconds)]
    return (statistics.median(measured), len(measured)) if measured else (math.nan, 0)


def print_plan(runs: Sequence[RunSpec], pretraining: dict[tuple[str, int], CfgNode], output_dir: str, jobs: int) -> None:
    """What the sweep is about to do and an estimate of its wall time, before it does anything: runs
    done and to run, backbones to pretrain first (a killed one's time counted from its last checkpoint in
    ``output_dir``)."""
    finished = [read_result(run.folder, RESULTS_FILE) for run in runs if is_finished(run.folder, RESULTS_FILE)]
    todo = len(runs) - len(finished)
    settings, seeds = len({run.setting for run in runs}), len({run.seed for run in runs})
    iterations = ", ".join(str(i) for i in sorted({run.iterations for run in runs}))
    print(f"Sweep: {settings} setting(s) x {seeds} seed(s) = {len(runs)} runs of {iterations} iterations; "
          f"{len(finished)} done, {todo} to run, --jobs {jobs}.", flush=True)  # fmt: skip
    missing = backbones_to_make(pretraining)
    if missing:
        print(f"First {len(missing)} backbone(s) not in the cache are pretrained, {min(jobs, len(missing))} at a "
              "time:", flush=True)  # fmt: skip
        for config in missing:
            norm, steps = pretrained_norm(config), trained_iterations(config)
            same_run = same_run_stop(config)
            if same_run is not None:
                how = (f"top-1 {config.PRETRAIN.STOP_TOP1:g} % first reached after {same_run[1]} iterations"
                       if same_run[1] else f"top-1 {config.PRETRAIN.STOP_TOP1:g} % not reached before its end: a copy")  # fmt: skip
                print(f"  {norm}, SEED {config.SEED}: made without training from the cached run it cuts short "
                      f"({how}): {same_run[0]}", flush=True)  # fmt: skip
                continue
            done = checkpointed_iterations(os.path.join(backbone_job_folder(output_dir, config), WORK_FOLDER))
            per_iter, count = cached_seconds_per_iteration(config)
            basis = (f"{per_iter:.2f} s/iter, the median of {count} cached {norm} backbone(s)' training time"
                     if count else f"no cached {norm} backbone to estimate from")  # fmt: skip
            resumed = f", resumed after {done} checkpointed" if done else ""
            at_most = f"at most (it stops at {config.PRETRAIN.STOP_TOP1:g} % top-1) " if config.PRETRAIN.STOP_TOP1 else ""
            print(f"  {norm}, SEED {config.SEED}, {at_most}{steps} iterations{resumed}: "
                  f"{format_duration(per_iter * (steps - done))} ({basis})", flush=True)  # fmt: skip
    if todo:
        per_run = statistics.median(result.wall_s for result in finished) if finished else math.nan
        at_once = min(jobs, todo)
        basis = (f"{todo} x {format_duration(per_run)}, the median wall time of the {len(finished)} finished run(s), "
                 f"/ {at_once} at once" if finished else "known once a run of this sweep has finished")  # fmt: skip
        print(f"Estimated wall time of the {todo} run(s) to run: {format_duration(todo * per_run / at_once)} "
              f"({basis}).", flush=True)  # fmt: skip


def backbone_job_folder(output_dir: str, config: CfgNode) -> str:
    """Where the sweep in ``output_dir`` pretrains the backbone of ``config`` until it is cached."""
    return os.path.join(output_dir, BACKBONE_WORK_FOLDER, os.path.basename(cached_backbone_folder(config)))


def make_backbones(configs: dict[tuple[str, int], CfgNode], output_dir: str, config_file: str, opts: Sequence[str],
                   best: Optional[dict[str, dict]] = None, jobs: int = 1) -> list[CfgNode]:  # fmt: skip
    """Pretrain the backbones of ``backbone_configs`` that are not cached yet, each once, as backbone jobs
    (``jobs.execute_job``), ``jobs`` at a time, in ``output_dir``/backbones/<cache folder>: checkpointed,
    so that a sweep killed there resumes them. ``config_file``, ``opts`` and ``best`` (``--backbones``) are
    what the configs were made from. Returns the configs whose backbone failed."""

    def name(config: CfgNode) -> str:
        return os.path.basename(cached_backbone_folder(config))

    def folder_of(config: CfgNode) -> str:
        return backbone_job_folder(output_dir, config)

    def run(config: CfgNode) -> bool:
        norm, cache, folder = pretrained_norm(config), cached_backbone_folder(config), folder_of(config)
        overrides = (best or {}).get(norm, {})
        logger.info("Backbone %s (pretrained with %s, SEED %d, %d iterations): made once, then cached (log: %s)",
                    name(config), norm, config.SEED, trained_iterations(config), os.path.join(folder, JOB_LOG))  # fmt: skip
        keys = [*opts, *override_list(overrides), "SEED", str(config.SEED)]
        record = {"norm": norm, "overrides": overrides, "seed": config.SEED, "cache_folder": cache}
        return execute_job(backbone_command(config_file, keys, norm, folder, cache), folder, record, jobs)

    return run_jobs(backbones_to_make(configs), run, jobs, done=is_cached, name=name,
                    log_of=lambda config: os.path.join(folder_of(config), JOB_LOG))  # fmt: skip


def plan_runs(
    cfg,
    config_file: str,
    settings: Sequence[Setting],
    seeds: Sequence[int],
    output_dir: str,
    iterations: Optional[int] = None,
    batch_average_batches: Optional[int] = None,
    opts: Sequence[str] = (),
    backbones: Optional[dict[tuple[str, int], str]] = None,
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


def execute(run: RunSpec, jobs: int = 1) -> bool:
    """Run (or resume) ``run`` with train_net (with its share of the threads when ``jobs`` run at once),
    its output into the run folder's train_net.log; returns whether it finished. Every attempt,
    interrupted ones too, is added to the run's record."""
    record = read_record(run.folder) or run.new_record()
    resumed = has_checkpoint(run.folder)
    stale_metrics = os.path.join(run.folder, METRICS_FILE)
    if not resumed and os.path.isfile(stale_metrics):
        os.remove(stale_metrics)  # train_net appends: a restart from scratch must not extend the old curve
    write_record(run.folder, record)
    code = code_version()
    start, returncode, command, env = time.perf_counter(), None, run.command(), child_environment(jobs)
    try:
        with open(os.path.join(run.folder, TRAIN_LOG), "a") as log:
            returncode = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        attempt = {"wall_s": round(time.perf_counter() - start, 1), "returncode": returncode, "resumed": resumed,
                   "threads": threads_of(env), "code": code}  # fmt: skip
        record["attempts"].append(attempt)
        write_record(run.folder, record)
    return returncode == 0 and is_finished(run.folder, RESULTS_FILE)


def run_sweep(
    runs: Sequence[RunSpec], report_after_each: Optional[Callable[[], object]] = None, jobs: int = 1
) -> list[RunSpec]:
    """Runs every unfinished run, ``jobs`` at a time in the order of ``runs`` (``check_folders(runs)``
    first); returns the runs that failed, in that order. ``report_after_each()`` is called after each
    run ends, so an interrupted sweep leaves the tables of what it finished."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    labels = {run.folder: f"[{i}/{len(runs)}] {run.setting.name} seed {run.seed}" for i, run in enumerate(runs, 1)}
    todo = []
    for run in runs:
        if is_finished(run.folder, RESULTS_FILE):
            logger.info("%s: finished earlier, skipped (%s)", labels[run.folder], run.folder)
        else:
            todo.append(run)

    def train(run: RunSpec) -> bool:
        log = os.path.join(run.folder, TRAIN_LOG)
        logger.info("%s: training %d iterations (log: %s)", labels[run.folder], run.iterations, log)
        return execute(run, jobs)

    def outcome(run: RunSpec) -> str:
        result = read_result(run.folder, RESULTS_FILE)
        return f"box AP {result.metrics['box_AP']:.1f}, mask AP {result.metrics['mask_AP']:.1f}, {result.wall_s:.0f} s"

    # execute() returns whether the run finished: nothing more to check once it has
    return run_jobs(todo, train, jobs, done=lambda run: True, name=lambda run: labels[run.folder],
                    log_of=lambda run: os.path.join(run.folder, TRAIN_LOG), after_each=report_after_each,
                    outcome=outcome)  # fmt: skip


def config_label(config_file: str) -> str:
    """How the table names ``config_file``: one of sn_detection's configs as ``configs/NAME``, its path in a
    checkout, however it was reached and whichever copy it is: a checkout's ``configs/`` (the folder beside
    ``sn_detection/``; any checkout, such as a worktree at the commit a sweep runs) or an installed
    package's ``sn_detection/configs``; any other as given."""
    folder, parts = os.path.realpath(config_file), []
    while os.path.dirname(folder) != folder:
        folder, part = os.path.split(folder)
        parts.insert(0, part)
        installed = os.path.basename(folder) == "sn_detection"
        if part == "configs" and (installed or os.path.isdir(os.path.join(folder, "sn_detection"))):
            return "/".join(parts)
    return config_file


def describe(
    cfg, config_file: str, runs: Sequence[RunSpec], backbones: Optional[tuple[str, dict]] = None,
    backbone_seeds: bool = False, stop_top1: Optional[float] = None,
) -> str:
    """The paragraph above the results table: what was trained and evaluated, and how to read it;
    ``stop_top1``: the top-1 ``--stop-top1`` put in place of the ``backbones`` file's."""
    config = config_label(config_file)
    seeds = sorted({run.seed for run in runs})
    iterations = sorted({run.iterations for run in runs})
    init = "trained from scratch" if not cfg.MODEL.WEIGHTS else f"trained from `{cfg.MODEL.WEIGHTS}`"
    tool = "tools/compare_norms.py"
    finetuned = any("MODEL.WEIGHTS" in run.train_args for run in runs)
    if finetuned:
        tool += " --finetune"
        init = (
            f"finetuned (stages up to res{cfg.MODEL.BACKBONE.FREEZE_AT} frozen) from a "
            f"ResNet-{cfg.MODEL.RESNETS.DEPTH} pretrained with the backbone's norm (FrozenBN: BN) on classification "
            f"(`{cfg.PRETRAIN.DATA}`, {cfg.PRETRAIN.MAX_ITER} iterations at batch {cfg.PRETRAIN.IMS_PER_BATCH}, "
            f"{cfg.PRETRAIN.IMAGE_SIZE} px; `tools/pretrain_backbone.py`)"
        )
        if backbones:
            path, best = backbones
            chosen = "; ".join(f"{norm}: " + ", ".join(f"{key} {value}" for key, value in overrides.items())
                               for norm, overrides in best.items())  # fmt: skip
            replaced = f", its PRETRAIN.STOP_TOP1 replaced by `--stop-top1 {stop_top1:g}`" if stop_top1 is not None else ""
            init += f", each norm with its PRETRAIN setting in `{path}`{replaced} (`tools/pretrain_grid.py`: {chosen})"
        init += (
            "; each seed from a backbone pretrained with that seed (`--backbone-seeds`: the spread includes the "
            "backbone's draw)," if backbone_seeds else
            f"; every seed from the one backbone pretrained with SEED {cfg.SEED} (the spread is the finetuning's "
            "only),"
        )  # fmt: skip
    title = "Norm settings compared on this machine"
    if finetuned and backbones:
        title = f"Norm settings finetuned from the backbones of `{os.path.basename(backbones[0])}`"
        if stop_top1 is not None:
            title += f", stopped at {stop_top1:g} % top-1"
    return (
        f"### {title} (`{tool}`, measured here)\n\n"
        f"Mask R-CNN R{cfg.MODEL.RESNETS.DEPTH}-FPN (`{config}`: {cfg.INPUT.MIN_SIZE_TEST} px inputs, FPN and "
        f"heads {cfg.MODEL.FPN.OUT_CHANNELS} wide) {init} on `{cfg.DATASETS.TRAIN[0]}` at "
        f"{cfg.SOLVER.IMS_PER_BATCH} images per batch for {', '.join(map(str, iterations))} iterations "
        f"(LR {cfg.SOLVER.BASE_LR}), once per seed ({', '.join(map(str, seeds))}); COCO box and mask AP "
        f"on `{cfg.DATASETS.TEST[0]}`, mean ± sample standard deviation over the seeds. A setting is the "
        "backbone's norm, then that of the FPN and both heads (FrozenBN is the paper's BN†, - no norm). "
        "*Test statistics*: with *batch average (K)*, "
        "the batch-dependent statistics (BN's running statistics, SN's BN branch, DN's) are recomputed from "
        "K training batches before evaluation (`TEST.BATCH_AVERAGE`, the SN paper's batch average; for BN "
        "it replaces the moving average, as detectron2's PreciseBN would); *–*: the setting has none. "
        "s/iter (median over training) and min/run (start-up, training, batch average and evaluation) are "
        f"wall-clock times on {os.cpu_count()} CPU cores, noisy where other work shared the machine."
        + (" *Backbone top-1*, where known: the val top-1 of the pretrained backbone the runs started from (one "
           "figure where every seed started from the same one); *backbone iterations*, where a backbone stopped at "
           "a top-1 (PRETRAIN.STOP_TOP1): the pretraining iterations it took; *short of the top-1*: backbones that "
           "never reached it and trained their whole schedule." if finetuned else "")
    )


def write_outputs(
    runs: Sequence[RunSpec], output_dir: str, description: str, publish: Optional[str]
) -> list[RunResult]:
    """The table, CSV and plots of the finished runs among ``runs`` (nothing before the first one);
    the table also to ``publish`` if given. Returns the results."""
    results = [read_result(run.folder, RESULTS_FILE, PRETRAINING_RESULTS_FILE) for run in runs
               if is_finished(run.folder, RESULTS_FILE)]  # fmt: skip
    if not results:
        logger.info("No finished run yet: no table written")
        return results
    order = list(dict.fromkeys(run.setting.name for run in runs))
    summaries = report.summarize(results, order)
    pairs = report.within_backbone_differences(results, order)
    started = [run for run in runs if read_record(run.folder) is not None]
    unfinished = [
        f"{run.setting.name} seed {run.seed}" for run in started if not is_finished(run.folder, RESULTS_FILE)
    ]
    description = f"{description.rstrip()} {report.code_sentence(results)}"
    os.makedirs(output_dir, exist_ok=True)
    report.write_markdown(os.path.join(output_dir, TABLE_FILE), description, summaries, unfinished, pairs)
    report.write_csv(os.path.join(output_dir, CSV_FILE), results, summaries)
    plots.plot_ap(summaries, results, os.path.join(output_dir, AP_PLOT_FILE))
    curves = {name: {} for name in order}
    for run in runs:
        curves[run.setting.name][run.seed] = loss_curve(run.folder)
    plots.plot_loss_curves({name: seeds for name, seeds in curves.items() if any(seeds.values())},
                           os.path.join(output_dir, CURVES_FILE))  # fmt: skip
    if publish:
        create_folder_of(publish)
        report.write_markdown(publish, description, summaries, unfinished, pairs)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train the same CPU-sized Mask R-CNN once per norm setting and seed and compare COCO AP."
    )
    parser.add_argument(
        "--finetune", action="store_true",
        help="finetune each backbone from one pretrained with its norm (the SN paper's protocol); without it, "
        "train from scratch",
    )  # fmt: skip
    parser.add_argument(
        "--config-file", metavar="FILE",
        help=f"the base config (default: {DEFAULT_CONFIG}; with --finetune {DEFAULT_FINETUNE_CONFIG})",
    )  # fmt: skip
    # extend: a setting that starts with '-' reads as an option unless attached (--settings=-/GN), and an
    # attached value takes no others after it, so --settings may repeat
    parser.add_argument(
        "--settings", nargs="+", action="extend", metavar="SETTING",
        help=f"NORM (backbone, FPN, heads) or BACKBONE/HEAD, - for none (write a setting that starts with - as "
        f"--settings=-/GN, one per --settings, which may repeat); default: {' '.join(DEFAULT_SETTINGS)}; "
        f"with --finetune {' '.join(FINETUNE_SETTINGS)}",
    )  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="default: %(default)s")
    parser.add_argument("--iters", type=int, help="iterations per run, the schedule scaled (default: the config's)")
    parser.add_argument(
        "--batch-average-batches", type=int, metavar="K",
        help="batches of the batch average for settings with batch statistics; 0: none (default: the config's)",
    )  # fmt: skip
    parser.add_argument(
        "--output-dir",
        help=f"one folder per run in it (default: {DEFAULT_OUTPUT_DIR}; with --finetune {DEFAULT_FINETUNE_OUTPUT_DIR})",
    )  # fmt: skip
    parser.add_argument(
        "--jobs", type=int, default=1, metavar="N",
        help="runs at once, the threads (OMP_NUM_THREADS, else the cores) split between them (default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--backbones", metavar="BEST_JSON",
        help="with --finetune: pretrain each backbone norm with its PRETRAIN setting in this file "
        f"(tools/pretrain_grid.py's best.json; FrozenBN: BN's); default --output-dir then {DEFAULT_BEST_OUTPUT_DIR}",
    )  # fmt: skip
    parser.add_argument(
        "--stop-top1", type=float, metavar="X",
        help="with --backbones: every backbone stops at val top-1 X (PRETRAIN.STOP_TOP1) in place of the file's, "
        "e.g. a common top-1 that every seed's backbone reaches; made without training where a cached run of "
        "the same setting kept its evaluated models",
    )  # fmt: skip
    parser.add_argument(
        "--backbone-seeds", action="store_true",
        help="with --finetune: seed k finetunes a backbone pretrained with SEED k, so that the spread over seeds "
        "includes the backbone's (default: every seed finetunes the backbone of the config's SEED)",
    )  # fmt: skip
    parser.add_argument(
        "--publish", metavar="FILE", type=output_file,
        help="also write the table here, e.g. model_zoo/sections/NAME.md: a section of model_zoo/README.md, which "
        "python -m sn_detection.model_zoo renders",
    )  # fmt: skip
    parser.add_argument("--report-only", action="store_true", help="only write the tables and plots of finished runs")
    parser.add_argument("--plan-only", action="store_true", help="print the plan and the estimate, run nothing")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides for every run")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
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
            args.backbone_settings = {norm: {**overrides, "PRETRAIN.STOP_TOP1": args.stop_top1}
                                      for norm, overrides in args.backbone_settings.items()}  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    return args


def check_finetune_settings(settings: Sequence[Setting]) -> None:
    """Finetuning starts from a backbone pretrained with its own norm: a backbone without one has none."""
    for setting in settings:
        if setting.backbone == NO_NORM:
            raise ValueError(
                f"--finetune: setting {setting.name!r} has no backbone norm, and finetuning starts from a backbone "
                f"pretrained with its norm; give the backbone one of {list(valid_norm_names())}"
            )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Returns the exit status: 1 if a run failed."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s compare_norms] %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    cfg = load_cfg(os.path.abspath(args.config_file), list(args.opts))
    # planned and checked before any pretraining, which takes the longest
    try:
        per_norm = pretraining_configs(cfg, args.settings, args.backbone_settings) if args.finetune else {}
        pretraining = backbone_configs(per_norm, args.seeds, args.backbone_seeds)
        backbones = {key: cached_backbone_path(config) for key, config in pretraining.items()} or None
        runs = plan_runs(
            cfg, args.config_file, args.settings, args.seeds, args.output_dir, args.iters, args.batch_average_batches,
            args.opts, backbones,
        )  # fmt: skip
        check_folders(runs)
    except ValueError as error:
        raise SystemExit(f"compare_norms: error: {error}") from None
    description = describe(cfg, args.config_file, runs,
                           (args.backbones, args.backbone_settings) if args.backbone_settings else None,
                           args.backbone_seeds, args.stop_top1)  # fmt: skip
    if args.backbone_settings:
        # the grid made each norm's backbone of the config's SEED; --backbone-seeds' others are new
        for norm, config in per_norm.items():
            if not is_cached(config):
                logger.warning("--backbones: the backbone of %s is not in the cache (%s): it is pretrained first; the "
                               "grid's config and KEY VALUE overrides would have made it", norm,
                               cached_backbone_path(config))  # fmt: skip
    if not args.report_only:
        print_plan(runs, pretraining, args.output_dir, args.jobs)
    if args.plan_only:
        return 0
    failed, runnable = [], runs
    if not args.report_only:
        failed_backbones = make_backbones(pretraining, os.path.abspath(args.output_dir), os.path.abspath(args.config_file),
                                          args.opts, args.backbone_settings, args.jobs)  # fmt: skip
        missing = {cached_backbone_path(config) for config in failed_backbones}
        failed = [run for run in runs if initial_weights(run.train_args) in missing]
        runnable = [run for run in runs if run not in failed]
        if failed:
            logger.error("not run, their backbone failed (its log is named above): %s",
                         ", ".join(f"{run.setting.name} seed {run.seed}" for run in failed))  # fmt: skip

    def write():
        return write_outputs(runs, args.output_dir, description, args.publish)

    failed += [] if args.report_only else run_sweep(runnable, report_after_each=write, jobs=args.jobs)
    results = write()
    logger.info("%d of %d runs finished; results in %s", len(results), len(runs), args.output_dir)
    if failed:
        logger.error("failed runs: %s", ", ".join(f"{run.setting.name} seed {run.seed}" for run in failed))
    return 1 if failed else 0
