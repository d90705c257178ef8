"""tools/train_net.py end to end on the embedded dataset: train, resume, evaluate, evaluate-only; a
resumed run against an uninterrupted one, and two processes with SyncSN and SN on the CPU."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import shrunk_training
import torch

from sn_detection.engine.launch import launch_processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The shrunk demo model with its evaluation on sn_shapes_val: a step and an evaluation take seconds.
EVALUATED = ["DATASETS.TEST", "('sn_shapes_val',)"]


def train_net(*opts, flags=()):
    return shrunk_training.train_shrunk(*EVALUATED, *opts, flags=flags)


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.json")) as f:
        return [json.loads(line) for line in f]


def assert_finite_ap(results):
    for task in ("bbox", "segm"):
        for key in ("AP", "AP50", "AP75"):
            assert math.isfinite(results[task][key]), (task, key, results[task])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 iterations without evaluation, then --resume to 5 iterations with evaluation at the end."""
    output_dir = str(tmp_path_factory.mktemp("train"))
    train_net("OUTPUT_DIR", output_dir, "SOLVER.MAX_ITER", "3", "DATASETS.TEST", "()")
    first_iterations = [row["iteration"] for row in read_metrics(output_dir) if "total_loss" in row]
    log = train_net("OUTPUT_DIR", output_dir, "SOLVER.MAX_ITER", "5", flags=["--resume"])
    return output_dir, first_iterations, log


def test_training_writes_metrics_and_final_ap(trained):
    output_dir, _, log = trained
    with open(os.path.join(output_dir, "eval_results.json")) as f:
        results = json.load(f)
    assert_finite_ap(results["sn_shapes_val"])
    rows = read_metrics(output_dir)
    assert any(math.isfinite(row["total_loss"]) for row in rows if "total_loss" in row)
    assert any("segm/AP" in row for row in rows)
    assert "Final results on sn_shapes_val: bbox AP" in log
    assert "copypaste: AP,AP50,AP75,APs,APm,APl" in log


def test_resume_continues_from_the_last_checkpoint(trained):
    output_dir, first_iterations, log = trained
    assert first_iterations and max(first_iterations) == 2
    assert "Resuming from iteration 3" in log or "Starting training from iteration 3" in log
    assert os.path.isfile(os.path.join(output_dir, "model_final.pth"))


def test_eval_only_reproduces_the_final_predictions_and_ap(trained, tmp_path):
    """The same detections, image by image (a model this briefly trained scores an AP near 0, which
    alone would tell little), and the same metrics."""
    output_dir, _, _ = trained
    weights = os.path.join(output_dir, "model_final.pth")
    train_net("MODEL.WEIGHTS", weights, "OUTPUT_DIR", str(tmp_path), flags=["--eval-only"])
    assert_same_evaluation(str(tmp_path), output_dir)


def assert_same_evaluation(eval_only_dir, training_dir):
    """The detections image by image, and every metric, of an --eval-only run and of the training run."""
    predictions = os.path.join("inference", "sn_shapes_val", "coco_instances_results.json")
    with open(os.path.join(training_dir, predictions)) as f:
        after_training = json.load(f)
    with open(os.path.join(eval_only_dir, predictions)) as f:
        eval_only = json.load(f)
    assert after_training and len(eval_only) == len(after_training)
    for got, expected in zip(eval_only, after_training):
        assert got.keys() == expected.keys() and got["segmentation"] == expected["segmentation"]
        assert (got["image_id"], got["category_id"]) == (expected["image_id"], expected["category_id"])
        assert [got["score"], *got["bbox"]] == pytest.approx([expected["score"], *expected["bbox"]], abs=1e-5)
    with open(os.path.join(training_dir, "eval_results.json")) as f:
        after_training = json.load(f)["sn_shapes_val"]
    with open(os.path.join(eval_only_dir, "eval_results.json")) as f:
        eval_only = json.load(f)["sn_shapes_val"]
    assert_finite_ap(eval_only)
    for task in ("bbox", "segm"):
        assert eval_only[task] == pytest.approx(after_training[task], abs=1e-6, nan_ok=True)


def test_eval_only_without_trained_weights_is_refused(tmp_path):
    """detectron2 would evaluate the untrained model ("No checkpoint found. Initializing model from scratch")."""
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "train_net.py"),
            "--config-file",
            shrunk_training.DEMO_CONFIG,
            "--eval-only",
            *shrunk_training.SHRINK,
            *EVALUATED,
            "OUTPUT_DIR",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode != 0
    assert "there are no weights to evaluate: MODEL.WEIGHTS is empty" in result.stderr
    assert not (tmp_path / "eval_results.json").exists()


@pytest.fixture(scope="module")
def extended_and_uninterrupted(tmp_path_factory):
    """The shrunk demo with SN (batch average), DN and MGN: 3 iterations, then --resume with MAX_ITER 5
    (a longer schedule); and 5 iterations in one run. The batch average runs every 3 iterations, so at
    the end of the first part in both."""
    common = [*shrunk_training.MIXED_NORMS, "TEST.EVAL_PERIOD", "3", "SEED", "4"]
    extended, uninterrupted = tmp_path_factory.mktemp("extended"), tmp_path_factory.mktemp("uninterrupted")
    shrunk_training.train_shrunk(*common, "SOLVER.MAX_ITER", "3", "OUTPUT_DIR", str(extended))
    log = shrunk_training.train_shrunk(*common, "SOLVER.MAX_ITER", "5", "OUTPUT_DIR", str(extended), flags=["--resume"])
    assert "Starting training from iteration 3" in log
    shrunk_training.train_shrunk(*common, "SOLVER.MAX_ITER", "5", "OUTPUT_DIR", str(uninterrupted))
    return extended, uninterrupted


def test_resumed_training_ends_with_the_uninterrupted_model(extended_and_uninterrupted):
    extended, uninterrupted = (torch.load(path / "model_final.pth") for path in extended_and_uninterrupted)
    assert extended["iteration"] == uninterrupted["iteration"] == 4
    assert extended["model"].keys() == uninterrupted["model"].keys()
    for key, value in uninterrupted["model"].items():
        assert torch.equal(extended["model"][key], value), key
    assert any(key.endswith("running_var") for key in uninterrupted["model"])
    for state in extended["trainer"]["hooks"]["BatchAverage"], uninterrupted["trainer"]["hooks"]["BatchAverage"]:
        assert state == {"batches_read": 4}


def test_two_processes_on_the_cpu_evaluate_the_model_they_save(tmp_path):
    """--num-gpus 2 without a GPU: two gloo processes train the shrunk demo with SyncSN in backbone and FPN
    and SN in the heads (2 images each), run SN's batch average, checkpoint and evaluate, each process
    half of the images. SN's statistics are per process, as BN's: the evaluation must use those of the
    checkpoint, so one process evaluating model_final.pth gives the same detections on every image. That
    SyncSN's statistics and batch average pool both processes' batches exactly is tested on the layer
    (tests/layers/test_sync_switchable.py) and in pretraining (two processes against one on the
    concatenated batch)."""
    norms = [
        "MODEL.RESNETS.NORM", "SyncSN", "MODEL.FPN.NORM", "SyncSN", "MODEL.ROI_BOX_HEAD.NORM", "SN",
        "MODEL.ROI_MASK_HEAD.NORM", "SN", "TEST.BATCH_AVERAGE.ENABLED", "True", "TEST.BATCH_AVERAGE.NUM_BATCHES", "2",
    ]  # fmt: skip
    training = [*norms, "SOLVER.IMS_PER_BATCH", "4", "SOLVER.MAX_ITER", "2", *EVALUATED]
    log = shrunk_training.train_shrunk(
        *training,
        "OUTPUT_DIR",
        str(tmp_path / "train"),
        flags=["--num-gpus", "2", "--dist-url", "auto"],
        env={"CUDA_VISIBLE_DEVICES": ""},  # the processes run on the CPU, also on a machine with one GPU
    )
    assert "World size: 2" in log
    assert "Final results on sn_shapes_val: bbox AP" in log
    shrunk_training.train_shrunk(
        *training,
        "MODEL.WEIGHTS",
        str(tmp_path / "train" / "model_final.pth"),
        "OUTPUT_DIR",
        str(tmp_path / "eval"),
        flags=["--eval-only"],
    )
    assert_same_evaluation(str(tmp_path / "eval"), str(tmp_path / "train"))
    model = torch.load(tmp_path / "train" / "model_final.pth")["model"]
    statistics = [value for key, value in model.items() if key.endswith(("running_mean", "running_var"))]
    assert statistics and all(value.isfinite().all() for value in statistics)


def test_more_processes_than_visible_gpus_are_refused_with_the_way_to_run_them_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = argparse.Namespace(num_gpus=2, num_machines=1, machine_rank=0, dist_url="auto")
    with pytest.raises(SystemExit, match=r"--num-gpus 2: torch sees 1 CUDA device.*CUDA_VISIBLE_DEVICES="):
        launch_processes(lambda arguments: None, args)
