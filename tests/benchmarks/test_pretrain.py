"""tools/benchmark_pretrain.py at a tiny size: one row per norm, BN first, each step of the per-device
batch the config and --devices give, and the epoch hours of that step; with --data, one loader worker's
speed on that folder and the workers each device needs; a batch the devices cannot share is refused,
and so are a count below 1, naming the option, and an unknown norm, with the valid names."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from tiny_pretraining import CONFIG, REPO

TOOL = os.path.join(REPO, "tools", "benchmark_pretrain.py")
TINY = ["PRETRAIN.IMAGE_SIZE", "32", "PRETRAIN.IMS_PER_BATCH", "12"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def benchmark(*args):
    command = [sys.executable, TOOL, "--config-file", CONFIG, "--rounds", "1", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_rows_time_each_norm_on_one_devices_share_of_the_batch(tmp_path):
    out = tmp_path / "rows.json"
    result = benchmark(
        "--norms", "SN,GN", "--devices", "3", "--classes", "7", "--epoch-images", "1200", "--json", out, *TINY
    )
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


def image_folder(root):
    """train/ and val/ with 2 classes of 3 JPEGs of 120 x 90 px."""
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for name in ("a", "b"):
            (root / split / name).mkdir(parents=True)
            for i in range(3):
                pixels = (torch.rand(90, 120, 3, generator=generator) * 255).byte().numpy()
                Image.fromarray(pixels).save(root / split / name / f"{i}.jpg")
    return root


def test_data_gives_one_workers_speed_and_the_workers_each_device_needs(tmp_path):
    out = tmp_path / "rows.json"
    result = benchmark(
        "--norms", "GN", "--devices", "2", "--data", image_folder(tmp_path / "images"), "--json", out, *TINY
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    loaded = rows[0]["loader_images_per_second_per_worker"]
    assert loaded > 0 and f"One loader worker on {tmp_path / 'images'}: {loaded:.1f} training samples" in result.stdout
    for row in rows:
        assert row["loader_images_per_second_per_worker"] == loaded
        assert row["workers_per_device"] == math.ceil(row["images_per_second_per_device"] / loaded) >= 1


def test_a_batch_the_devices_cannot_share_is_refused():
    result = benchmark("--devices", "5", *TINY)
    assert result.returncode != 0
    assert "PRETRAIN.IMS_PER_BATCH=12 is not divisible by --devices 5" in result.stderr


def test_an_unknown_norm_is_refused_with_the_choices():
    result = benchmark("--norms", "XN", "--devices", "2", *TINY)
    assert result.returncode != 0
    assert "MODEL.RESNETS.NORM: unknown norm 'XN'; valid names are [" in result.stderr


@pytest.mark.parametrize("option", ["--devices", "--classes", "--epoch-images", "--rounds"])
def test_a_count_below_one_is_refused_naming_the_option(option):
    result = benchmark(option, "0", *TINY)
    assert result.returncode == 2
    assert f"error: argument {option}: 0 is invalid: it must be an int >= 1" in result.stderr
