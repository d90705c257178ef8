"""Writing is atomic (a failure midway leaves the previous file or nothing), and the command line works
end to end as a separate process."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from resnet_sources import read_converted, torchvision_resnet

from sn_detection.conversion import files, write_checkpoint
from sn_detection.conversion.cli import EXIT_FAILURE, main

REPOSITORY = Path(__file__).resolve().parents[2]
STATE = {"stem.conv1.weight": torch.randn(64, 3, 7, 7), "stem.conv1.norm.bias": torch.randn(64)}


def failing_writer(exception):
    def write(checkpoint, stream):
        stream.write(b"half a checkpoint")
        raise exception

    return write


@pytest.mark.parametrize("exception", [OSError("disk full"), KeyboardInterrupt()])
def test_failure_midway_leaves_nothing(tmp_path, monkeypatch, exception):
    monkeypatch.setitem(files.WRITERS, ".pkl", failing_writer(exception))
    with pytest.raises(type(exception)):
        write_checkpoint(STATE, str(tmp_path / "out.pkl"), author="test")
    assert list(tmp_path.iterdir()) == []


def test_failure_midway_keeps_the_previous_file(tmp_path, monkeypatch):
    destination = tmp_path / "out.pth"
    destination.write_bytes(b"previous checkpoint")
    monkeypatch.setitem(files.WRITERS, ".pth", failing_writer(OSError("disk full")))
    with pytest.raises(OSError):
        write_checkpoint(STATE, str(destination), author="test")
    assert destination.read_bytes() == b"previous checkpoint"
    assert list(tmp_path.iterdir()) == [destination]


@pytest.mark.parametrize("suffix", [".pkl", ".pth"])
def test_written_checkpoint_format(tmp_path, suffix):
    destination = tmp_path / f"out{suffix}"
    write_checkpoint(STATE, str(destination), author="sn_detection test")
    if suffix == ".pkl":
        with open(destination, "rb") as stream:
            checkpoint = pickle.load(stream)
    else:
        checkpoint = torch.load(destination, weights_only=True)
    assert checkpoint["__author__"] == "sn_detection test" and checkpoint["matching_heuristics"] is True
    for key, value in read_converted(destination).items():
        torch.testing.assert_close(value, STATE[key])
    mask = os.umask(0)
    os.umask(mask)
    assert destination.stat().st_mode & 0o777 == 0o666 & ~mask


def run_tool(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(REPOSITORY / "tools" / "convert_pretrained.py"), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_command_line(tmp_path):
    source = tmp_path / "resnet18.pth"
    torch.save(torchvision_resnet(18, seed=9).state_dict(), source)
    result = run_tool(source, tmp_path / "r18.pkl", "--source", "torchvision", "--norm", "sn")
    assert result.returncode == 0, result.stderr
    assert "ResNet-18 -> detectron2 ResNet keys for norm SN" in result.stdout
    assert "INPUT.FORMAT RGB" in result.stdout and "MODEL.RESNETS.STRIDE_IN_1X1 False" in result.stdout
    assert "SwitchableNorm2d's init (mean_weight)" in result.stdout
    assert read_converted(tmp_path / "r18.pkl")["res5.1.conv2.norm.var_weight"].shape == (3,)

    failed = run_tool(source, tmp_path / "r18_gn.pkl", "--source", "gn")
    assert failed.returncode == 2
    assert "error:" in failed.stderr and "not a pickle" in failed.stderr
    assert not (tmp_path / "r18_gn.pkl").exists()


@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("source") / "resnet18.pth"
    torch.save(torchvision_resnet(18, seed=9).state_dict(), path)
    return path


def test_conversion_interrupted_midway_writes_nothing(resnet18_file, tmp_path, monkeypatch, capsys):
    """The command line converts, starts writing, fails: status 2, the error printed, no file and no
    temporary file left."""
    monkeypatch.setitem(files.WRITERS, ".pkl", failing_writer(OSError("No space left on device")))
    assert main([str(resnet18_file), str(tmp_path / "r18.pkl"), "--source", "torchvision"]) == EXIT_FAILURE
    assert "error: No space left on device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_conversion_into_a_missing_directory_makes_it(resnet18_file, tmp_path, capsys):
    """The documented ``tools/convert_pretrained.py SRC pretrained/R-50-SN.pkl ...`` on a fresh clone."""
    destination = tmp_path / "pretrained" / "r18.pkl"
    assert main([str(resnet18_file), str(destination), "--source", "torchvision"]) == 0
    assert f"wrote {destination}" in capsys.readouterr().out
    assert os.listdir(tmp_path / "pretrained") == ["r18.pkl"]
