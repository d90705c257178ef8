"""sn_detection.experiments.jobs: a backbone job makes only the planned backbone, and every attempt at a job
is recorded, a cut-off one up to its output's end. (Jobs that pretrain are run end to end by the grid's
and the finetune sweep's tests.)"""

import json
import os
import re
import subprocess
import sys

from sn_detection.experiments import jobs
from sn_detection.experiments.compare_norms.plan import DEFAULT_FINETUNE_CONFIG


def test_a_backbone_job_refuses_a_config_whose_cache_folder_is_not_the_planned(tmp_path, monkeypatch):
    monkeypatch.setenv("SN_DETECTION_PRETRAINED", str(tmp_path / "cache"))
    work = tmp_path / "job" / jobs.WORK_FOLDER
    planned = str(tmp_path / "cache" / "resnet18-BN-000000000000")
    arguments = [
        "--work-dir",
        str(work),
        "--expect-cache",
        planned,
        "--norm",
        "BN",
        "--config-file",
        DEFAULT_FINETUNE_CONFIG,
        "PRETRAIN.BASE_LR",
        "0.1",
    ]
    # as the tools start it: a subprocess (whose loggers are its own)
    job = subprocess.run(
        [sys.executable, *jobs.JOB_MODULE, *arguments],
        env=jobs.child_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode != 0
    assert re.search(r"the config's cache folder .*resnet18-BN-\w+ is not the planned .*000000000000", job.stderr)
    assert not work.exists() and not (tmp_path / "cache").exists()  # nothing trained, nothing cached


def test_every_attempt_is_recorded_with_its_threads_and_a_cut_off_one_up_to_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    folder = str(tmp_path / "job")
    failing = [sys.executable, "-c", "import os, sys; print('threads', os.environ['OMP_NUM_THREADS']); sys.exit(3)"]
    assert not jobs.execute_job(failing, folder, {"norm": "BN"}, jobs=2)
    record = jobs.read_job_record(folder)
    (attempt,) = record["attempts"]
    assert record["norm"] == "BN" and attempt["returncode"] == 3 and attempt["threads"] == 2
    assert not attempt["resumed"] and attempt["wall_s"] is not None
    assert "threads 2" in open(os.path.join(folder, jobs.JOB_LOG)).read()  # its share of the threads

    # a parent killed with its job never closed the attempt: it ends where the log stopped changing
    path = os.path.join(folder, jobs.JOB_RECORD)
    log_changed = os.path.getmtime(os.path.join(folder, jobs.JOB_LOG))
    record["attempts"].append({"started": log_changed - 7.5, "wall_s": None, "returncode": None, "resumed": False})
    with open(path, "w") as f:
        json.dump(record, f)
    assert jobs.execute_job([sys.executable, "-c", "pass"], folder, {"norm": "other"}, jobs=1)
    first, cut_off, last = jobs.read_job_record(folder)["attempts"]
    assert cut_off["interrupted"] and cut_off["wall_s"] == 7.5
    assert last["returncode"] == 0 and last["threads"] == 4 and jobs.read_job_record(folder)["norm"] == "BN"
    assert first["code"] == last["code"] == jobs.code_version()


def git(folder, *args):
    environment = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(
        ["git", "-C", str(folder), *args], env=environment, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_the_code_version_is_the_checkouts_commit_and_whether_its_tracked_files_changed(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    git(checkout, "init", "-q")
    (checkout / "code.py").write_text("x = 1\n")
    git(checkout, "add", "code.py")
    git(checkout, "commit", "-q", "-m", "one")
    commit = git(checkout, "rev-parse", "HEAD")
    assert jobs.code_version(str(checkout)) == f"git {commit}"
    (checkout / "untracked.txt").write_text("not code\n")  # output beside the code is not a change of it
    assert jobs.code_version(str(checkout)) == f"git {commit}"
    (checkout / "code.py").write_text("x = 2\n")
    assert jobs.code_version(str(checkout)) == f"git {commit} + changes"

    # a folder inside a checkout is not one (an installed package under a repository): the version
    (checkout / "package").mkdir()
    assert jobs.code_version(str(checkout / "package")) == "sn_detection " + __import__("sn_detection").__version__
    assert jobs.code_version(str(tmp_path)) == "sn_detection " + __import__("sn_detection").__version__


def test_run_jobs_returns_the_failed_in_plan_order_and_checks_each_is_done():
    ran, reported = [], []

    def run(job):
        ran.append(job)
        return job != "b"  # "b" exits with an error; "c" exits well but makes nothing

    failed = jobs.run_jobs(
        ["a", "b", "c", "d"],
        run,
        2,
        done=lambda job: job != "c",
        name=str,
        log_of=str,
        after_each=lambda: reported.append(len(ran)),
    )
    assert failed == ["b", "c"] and sorted(ran) == ["a", "b", "c", "d"] and len(reported) == 4


def test_checkpointed_iterations_are_those_before_the_last_checkpoint(tmp_path, caplog):
    """What an estimate takes off a resumed job: the last checkpoint's iteration + 1 (detectron2 saves the
    index of the iteration just finished); nothing without a checkpoint, or with one that cannot be read."""
    assert jobs.checkpointed_iterations(str(tmp_path)) == 0
    checkpointer = jobs.DetectionCheckpointer(jobs.nn.Linear(1, 1), save_dir=str(tmp_path))
    checkpointer.save("model_0000009", iteration=9)
    assert jobs.checkpointed_iterations(str(tmp_path)) == 10
    checkpointer.save("model_0000019", iteration=19)
    assert jobs.checkpointed_iterations(str(tmp_path)) == 20
    (tmp_path / "model_0000019.pth").write_bytes(b"cut off")  # a half-written file, as a kill may leave
    assert jobs.checkpointed_iterations(str(tmp_path)) == 0
    assert "cannot read the checkpoint" in caplog.text and "model_0000019.pth" in caplog.text
