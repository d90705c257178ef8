"""The model zoo from a built wheel: installed into a folder of its own and imported from there, with the
repository out of sight, every catalog config and every LazyConfig loads."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from sn_detection import model_zoo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the check, run by the installed package: what it loaded, as JSON on the last line
CHECK = textwrap.dedent(
    """
    import json, os, sys
    import sn_detection
    from sn_detection import model_zoo

    yaml = {}
    for name in model_zoo.names():
        cfg = model_zoo.get_config(name)
        yaml[name] = [cfg.MODEL.RESNETS.NORM, cfg.MODEL.FPN.NORM]
    lazy = {}
    for name in model_zoo.lazy_names():
        cfg = model_zoo.get_lazy_config(name)
        lazy[name] = cfg.model.backbone.bottom_up.stages.norm.name
    print(json.dumps({"file": sn_detection.__file__, "config_dir": model_zoo.CONFIG_DIR, "yaml": yaml,
                      "lazy": lazy, "path": [os.path.realpath(entry) for entry in sys.path]}))
    """
)


def _run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The folder a wheel built from a copy of the repository is installed into (no dependencies)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    # a copy, so that setuptools' build/ and egg-info stay out of the checkout; only what a clone has
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "output")
    shutil.copytree(REPO, source, symlinks=True, ignore=ignore)
    wheels, target = tmp / "wheels", tmp / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)])
    (wheel,) = wheels.glob("sn_detection-*.whl")
    _run(pip + ["install", "--no-deps", "--no-index", "--target", str(target), str(wheel)])
    return target


def test_the_wheel_serves_every_config_without_the_repository(installed, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)  # first on sys.path, before site-packages and its editable finder
    result = _run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env)
    loaded = json.loads(result.stdout.strip().splitlines()[-1])

    assert os.path.commonpath([loaded["file"], str(installed)]) == str(installed), loaded["file"]
    assert os.path.commonpath([loaded["config_dir"], str(installed)]) == str(installed)
    assert os.path.realpath(REPO) not in loaded["path"]

    # the norms of each config, as the catalog has them (the backbone's; the FPN's is the head's)
    assert set(loaded["yaml"]) == set(model_zoo.names())
    for entry in model_zoo.CATALOG:
        backbone, fpn = loaded["yaml"][entry.name]
        assert backbone == entry.backbone, entry.name
        if entry.setting != 1:  # setting 1 (C4) has no FPN
            assert fpn == entry.head, entry.name
    assert loaded["lazy"] == {
        "demo_mask_rcnn_sn": "SN", "mask_rcnn_dn_2x": "DN", "mask_rcnn_gn_lsj_100ep": "GN", "mask_rcnn_mgn_2x": "MGN",
        "mask_rcnn_sn_2x": "SN", "mask_rcnn_sn_lsj_100ep": "SyncSN",
    }  # fmt: skip
    assert tuple(loaded["lazy"]) == model_zoo.lazy_names()


def test_rendering_from_the_wheel_says_it_needs_a_checkout(installed, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    result = subprocess.run(
        [sys.executable, "-m", "sn_detection.model_zoo"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "run this from a checkout" in result.stderr
