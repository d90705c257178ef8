"""Running a norm comparison: the backbones of ``--finetune`` that are not cached yet, as backbone jobs
(``jobs.execute_job``), then every unfinished run as a subprocess of train_net (``execute``), ``--jobs`` at a
time; every attempt recorded in the run's folder."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Sequence

from detectron2.config import CfgNode

from ...engine.trainer import RESULTS_FILE
from ...pretraining.cache import cached_backbone_folder, is_cached
from ...pretraining.model import pretrained_norm
from ...pretraining.train import trained_iterations
from ..backbones import override_list
from ..jobs import (
    JOB_LOG,
    backbone_command,
    child_environment,
    code_version,
    execute_job,
    has_checkpoint,
    run_jobs,
    threads_of,
)
from .plan import RunSpec, backbone_job_folder, backbones_to_make
from .runs import METRICS_FILE, is_finished, read_record, read_result, write_record

logger = logging.getLogger(__name__)

TRAIN_LOG = "train_net.log"


def make_backbones(
    configs: dict[tuple[str, int], CfgNode],
    output_dir: str,
    config_file: str,
    opts: Sequence[str],
    best: dict[str, dict] | None = None,
    jobs: int = 1,
) -> list[CfgNode]:
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
        logger.info(
            "Backbone %s (pretrained with %s, SEED %d, %d iterations): made once, then cached (log: %s)",
            name(config),
            norm,
            config.SEED,
            trained_iterations(config),
            os.path.join(folder, JOB_LOG),
        )
        keys = [*opts, *override_list(overrides), "SEED", str(config.SEED)]
        record = {"norm": norm, "overrides": overrides, "seed": config.SEED, "cache_folder": cache}
        return execute_job(backbone_command(config_file, keys, norm, folder, cache), folder, record, jobs)

    return run_jobs(
        backbones_to_make(configs),
        run,
        jobs,
        done=is_cached,
        name=name,
        log_of=lambda config: os.path.join(folder_of(config), JOB_LOG),
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
        attempt = {
            "wall_s": round(time.perf_counter() - start, 1),
            "returncode": returncode,
            "resumed": resumed,
            "threads": threads_of(env),
            "code": code,
        }
        record["attempts"].append(attempt)
        write_record(run.folder, record)
    return returncode == 0 and is_finished(run.folder, RESULTS_FILE)


def run_sweep(
    runs: Sequence[RunSpec], report_after_each: Callable[[], object] | None = None, jobs: int = 1
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
    return run_jobs(
        todo,
        train,
        jobs,
        done=lambda run: True,
        name=lambda run: labels[run.folder],
        log_of=lambda run: os.path.join(run.folder, TRAIN_LOG),
        after_each=report_after_each,
        outcome=outcome,
    )
