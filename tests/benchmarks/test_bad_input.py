"""tools/benchmark_norms.py and tools/benchmark_train.py refuse bad input within seconds, before anything
is timed: a count below 1 with an argparse error naming the option, and a norm setting the config
cannot build with the reason (validate_sn_config), not detectron2's KeyError from inside the model."""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tool(name, *args):
    command = [sys.executable, os.path.join(REPO, "tools", name), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "name, option",
    [("benchmark_norms.py", "--repeats"), ("benchmark_train.py", "--rounds"), ("benchmark_train.py", "--threads")],
)
def test_a_count_below_one_is_refused_naming_the_option(name, option):
    result = tool(name, option, "0")
    assert result.returncode == 2
    assert f"error: argument {option}: 0 is invalid: it must be an int >= 1" in result.stderr


def test_benchmark_train_refuses_a_norm_the_meta_architecture_cannot_build():
    result = tool("benchmark_train.py", "--rounds", "1", "--norms", "SN", "MODEL.META_ARCHITECTURE", "GeneralizedRCNN")
    assert result.returncode != 0 and "KeyError" not in result.stderr
    assert "MODEL.FPN.NORM='SN' is a norm of sn_detection" in result.stderr and "'SNMetaArch'" in result.stderr


def test_benchmark_train_refuses_an_unknown_norm_with_the_valid_names():
    result = tool("benchmark_train.py", "--rounds", "1", "--norms", "XN")
    assert result.returncode != 0 and "unknown norm 'XN'; valid names are [" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_benchmark_norms_refuses_cuda_where_there_is_none():
    result = tool("benchmark_norms.py", "--device", "cuda")
    assert result.returncode == 2 and "--device cuda: torch sees no CUDA device" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_gpu_checks_refuse_where_there_is_no_gpu(tmp_path):
    command = [os.path.join(REPO, "tools", "gpu_checks.sh"), str(tmp_path / "out")]
    result = subprocess.run(
        command, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "torch sees no CUDA device: nothing to check here" in result.stderr
