"""The work the sweeps run in subprocesses, ``jobs`` at a time on a share of the threads each
(``run_jobs``, ``child_environment``): tools/compare_norms.py's train_net runs, and backbone jobs, which
make the cells of tools/pretrain_grid.py and the backbones a finetune sweep lacks.

A backbone job is one backbone of the cache (``sn_detection.pretraining.cache.cached_backbone``) and a folder
of its own: ``training/`` (the work folder, checkpointed every PRETRAIN.CHECKPOINT_PERIOD iterations, so that a
job killed mid-way continues from its last checkpoint the next time; removed once the backbone is in the
cache), ``pretrain.log`` (its output, appended by every attempt) and ``cell.json`` (what it makes, and
every attempt: start, wall time, exit status, resumed or not, threads, ``code_version``). An attempt is
recorded as it starts, so that one cut off with its parent still counts: its wall time ends at the log's
last change.

Its subprocess is ``python -m sn_detection.experiments.jobs --work-dir W --expect-cache C --norm N --config-file
F [KEY VALUE ...]``: it loads the config as the parent did and refuses to train if its cache folder is
not C, so a job never makes a backbone other than the one planned.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
from detectron2.checkpoint import DetectionCheckpointer
from torch import nn

from ..engine.launch import load_cfg
from ..pretraining.cache import cached_backbone, cached_backbone_folder

logger = logging.getLogger(__name__)

JOB_MODULE = ("-m", "sn_detection.experiments.jobs")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_RECORD = "cell.json"  # the name the grid's cell folders already hold
JOB_LOG = "pretrain.log"
WORK_FOLDER = "training"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def child_environment(jobs: int = 1) -> dict:
    """The environment of a subprocess of a tool's: this one, with this sn_detection first on the import
    path, so that it uses the same package as its parent even where that is not installed, and with
    ``jobs`` processes at once, its share of the threads (``OMP_NUM_THREADS``, else the usable cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    if jobs > 1:
        env["OMP_NUM_THREADS"] = str(max(1, threads_of(env) // jobs))
    return env


def threads_of(env: dict) -> int:
    """The intra-op threads torch starts with in ``env``. Recorded with every attempt: on the CPU a run is
    the same bit for bit only at the same thread count (and CPU); another one sums in another order and
    trains a run as different as another seed's."""
    return int(env.get("OMP_NUM_THREADS") or usable_cores())


def code_version(root: str = PACKAGE_ROOT) -> str:
    """The code a subprocess runs, recorded with every attempt: ``git <commit>`` of the checkout at ``root``
    (the sn_detection on a child's path), with `` + changes`` where its tracked files differ from that
    commit; ``sn_detection <version>`` where ``root`` is not a checkout's top folder (an installed package).
    A rounding-level change of the code trains a run as different as another seed's, so two runs compare
    bit for bit only at the same code, threads and CPU."""

    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):  # no git, or a hung one: the version below
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    commit = git("rev-parse", "HEAD") if top and os.path.samefile(top, root) else None
    if commit is None:
        from .. import __version__

        return f"sn_detection {__version__}"
    changes = git("status", "--porcelain", "--untracked-files=no")
    return f"git {commit}" + (" + changes" if changes else "")


def has_checkpoint(folder: str) -> bool:
    """Whether a resumed training would continue from a checkpoint in ``folder`` (asked of detectron2's
    checkpointer, which needs a model to be built; an empty one does)."""
    return DetectionCheckpointer(nn.Module(), save_dir=folder).has_checkpoint()


def checkpointed_iterations(folder: str) -> int:
    """How many iterations a training resumed in ``folder`` does not run again, for an estimate: its last
    checkpoint's iteration + 1; 0 without a checkpoint, or with one that cannot be read (logged: resuming
    from it fails in the job, which is where that error belongs, not in the estimate before every job)."""
    checkpointer = DetectionCheckpointer(nn.Module(), save_dir=folder)
    if not checkpointer.has_checkpoint():
        return 0
    path = checkpointer.get_checkpoint_file()
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # any unreadable file: the estimate counts it as not started
        logger.warning(
            "cannot read the checkpoint %s (%s): the estimate counts its training from the start", path, error
        )
        return 0
    return int(state.get("iteration", -1)) + 1


def read_json(path: str):
    """The JSON value in ``path``; None if there is no such file."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_json(path: str, value) -> None:
    """Write ``value`` atomically, so that an interrupted tool never leaves half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=2)
    os.replace(path + ".tmp", path)


def seconds_per_iteration(metrics_path: str) -> float:
    """The median of detectron2's per-iteration time in a pretraining's metrics.json (the whole step,
    data loading included; every attempt's, where it was resumed); NaN without one."""
    if not os.path.isfile(metrics_path):
        return math.nan
    with open(metrics_path) as f:
        times = [row["time"] for row in map(json.loads, filter(str.strip, f)) if "time" in row]
    return statistics.median(times) if times else math.nan


def backbone_command(config_file: str, opts: Sequence[str], norm: str, folder: str, expected_cache: str) -> list[str]:
    """The subprocess that makes the backbone of ``config_file`` with ``opts`` (KEY VALUE) and backbone norm
    ``norm`` in ``folder``, refusing if that is not the one of ``expected_cache``."""
    return [
        sys.executable,
        *JOB_MODULE,
        "--work-dir",
        os.path.join(folder, WORK_FOLDER),
        "--expect-cache",
        expected_cache,
        "--norm",
        norm,
        "--config-file",
        config_file,
        *opts,
    ]


def close_interrupted_attempts(record: dict, log_path: str) -> dict:
    """Attempts that never saw their end (the parent was killed with them) ended at the job log's last
    change, where their output stopped: their wall time is counted up to there."""
    for attempt in record["attempts"]:
        if attempt["wall_s"] is None:
            ended = os.path.getmtime(log_path) if os.path.isfile(log_path) else attempt["started"]
            attempt.update(wall_s=round(max(0.0, ended - attempt["started"]), 1), interrupted=True)
    return record


def read_job_record(folder: str) -> dict | None:
    """The backbone job's record, its interrupted attempts closed; None if no job ran in ``folder``."""
    record = read_json(os.path.join(folder, JOB_RECORD))
    return close_interrupted_attempts(record, os.path.join(folder, JOB_LOG)) if record else None


def execute_job(command: list[str], folder: str, new_record: dict, jobs: int) -> bool:
    """Run (or resume) one backbone job in a subprocess with its share of the threads, its output into the job's
    log; ``new_record`` (what the job makes) starts the record of a job never run. Returns whether the
    subprocess succeeded."""
    path, log_path = os.path.join(folder, JOB_RECORD), os.path.join(folder, JOB_LOG)
    record = read_job_record(folder) or {**new_record, "attempts": []}
    env = child_environment(jobs)
    attempt = {
        "started": round(time.time(), 1),
        "wall_s": None,
        "returncode": None,
        "resumed": has_checkpoint(os.path.join(folder, WORK_FOLDER)),
        "threads": threads_of(env),
        "code": code_version(),
    }
    record["attempts"].append(attempt)
    write_json(path, record)
    start, returncode = time.perf_counter(), None
    try:
        with open(log_path, "a") as log:
            returncode = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        attempt.update(wall_s=round(time.perf_counter() - start, 1), returncode=returncode)
        write_json(path, record)
    return returncode == 0


def run_jobs(
    todo: Sequence,
    run: Callable[[object], bool],
    jobs: int,
    done: Callable[[object], bool],
    name: Callable[[object], str],
    log_of: Callable[[object], str],
    after_each: Callable[[], object] | None = None,
    outcome: Callable[[object], str] = lambda job: "done",
) -> list:
    """``run(job)`` for each of ``todo``, ``jobs`` at a time in order; a job failed unless ``run`` returned
    True and ``done(job)``. Each end is logged (``outcome(job)`` of a job done, ``log_of(job)`` of one
    failed), then ``after_each()`` is called. Returns the failed jobs, in order."""
    failed = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run, job): job for job in todo}
        for future in as_completed(futures):
            job = futures[future]
            if future.result() and done(job):
                logger.info("%s: %s", name(job), outcome(job))
            else:
                failed.append(job)
                logger.error("%s: failed, see %s", name(job), log_of(job))
            if after_each is not None:
                after_each()
    return [job for job in todo if job in failed]


def main(argv: Sequence[str] | None = None) -> int:
    """One backbone job, in its own process: the backbone of the config with the norm and the overrides, made in
    the work folder (resumed) and moved into the cache; refused if its cache folder is not the planned."""
    parser = argparse.ArgumentParser(prog="python -m sn_detection.experiments.jobs")
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--expect-cache", required=True)
    parser.add_argument("--norm", required=True)
    parser.add_argument("--config-file", required=True)
    parser.add_argument("opts", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    from detectron2.utils.logger import setup_logger

    setup_logger(name="detectron2")
    setup_logger(name="sn_detection")
    cfg = load_cfg(args.config_file, [*args.opts, "MODEL.RESNETS.NORM", args.norm])
    if cached_backbone_folder(cfg) != args.expect_cache:
        raise SystemExit(
            f"backbone job: the config's cache folder {cached_backbone_folder(cfg)} is not the planned "
            f"{args.expect_cache}"
        )
    print(cached_backbone(cfg, work_dir=args.work_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
