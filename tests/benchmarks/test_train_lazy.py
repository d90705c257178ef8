"""tools/benchmark_train.py on a LazyConfig: the norms set in its five norm places (ours as factories,
detectron2's by name), a row per setting with its reference; the graphed backbone and mixed precision
refused off CUDA with what is wrong, before anything is timed."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def benchmark(*args):
    command = [sys.executable, os.path.join(REPO, "tools", "benchmark_train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_a_lazy_config_is_timed_per_norm(tmp_path):
    rows_file = tmp_path / "rows.json"
    result = benchmark(
        "--config-file",
        "configs/lazy/demo_mask_rcnn_sn.py",
        "--norms",
        "GN,FrozenBN",
        "--rounds",
        "1",
        "--json",
        str(rows_file),
        "train.device=cpu",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    assert [(row["setting"], row["norm"], row["graphed_backbone"], row["reference"]) for row in rows] == [
        ("GN", "GN", False, "GN"),
        ("FrozenBN", "FrozenBN", False, "GN"),
    ]
    assert rows[0]["train_vs_gn"] == 1.0 and all(row["train_seconds"] > 0 for row in rows)
    assert "setting    train step s   x GN" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals where torch sees no CUDA device")
@pytest.mark.parametrize(
    "args, message",
    [
        (["--graphed-backbone"], "--graphed-backbone replays CUDA graphs, and the model is on cpu"),
        (
            ["--config-file", "configs/lazy/mask_rcnn_gn_lsj_100ep.py"],
            "train.amp.enabled=True: mixed precision is timed on CUDA only, and the model is on cpu",
        ),
    ],
    ids=["graphs", "amp"],
)
def test_what_needs_cuda_is_refused_off_cuda(args, message):
    result = benchmark("--rounds", "1", *args)
    assert result.returncode != 0 and message in result.stderr
