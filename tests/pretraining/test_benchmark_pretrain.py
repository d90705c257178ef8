"""tools/benchmark_pretrain.py at a tiny size: one row per norm, BN first, each step of the per-device
batch the config and --devices give, and the epoch hours of that step; a batch the devices cannot share
is refused, and so is an unknown norm, with the valid names."""

import json
import os
import subprocess
import sys

import pytest
from tiny_pretraining import CONFIG, REPO

TOOL = os.path.join(REPO, "tools", "benchmark_pretrain.py")
TINY = ["PRETRAIN.IMAGE_SIZE", "32", "PRETRAIN.IMS_PER_BATCH", "12"]


def benchmark(*args):
    command = [sys.executable, TOOL, "--config-file", CONFIG, "--rounds", "1", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_rows_time_each_norm_on_one_devices_share_of_the_batch(tmp_path):
    out = tmp_path / "rows.json"
    result = benchmark("--norms", "SN,GN", "--devices", "3", "--classes", "7", "--epoch-images", "1200",
                       "--json", out, *TINY)  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert [row["norm"] for row in rows] == ["BN", "SN", "GN"]
    assert "ResNet-18, 32 px, 4 images per step (12 over 3 devices), fp32" in result.stdout
    for row in rows:
        assert (row["depth"], row["images_per_step"], row["devices"], row["ims_per_batch"]) == (18, 4, 3, 12)
        assert row["step_seconds"] > 0 and row["norm"] in result.stdout
        assert row["images_per_second_per_device"] == pytest.approx(4 / row["step_seconds"])
        assert row["epoch_hours"] == pytest.approx(1200 / 12 * row["step_seconds"] / 3600)
    assert rows[0]["step_vs_bn"] == 1.0
    assert rows[1]["step_vs_bn"] == pytest.approx(rows[1]["step_seconds"] / rows[0]["step_seconds"])


def test_a_batch_the_devices_cannot_share_is_refused():
    result = benchmark("--devices", "5", *TINY)
    assert result.returncode != 0
    assert "PRETRAIN.IMS_PER_BATCH=12 is not divisible by --devices 5" in result.stderr


def test_an_unknown_norm_is_refused_with_the_choices():
    result = benchmark("--norms", "XN", "--devices", "2", *TINY)
    assert result.returncode != 0
    assert "XN" in result.stderr and "SN" in result.stderr
