"""The model zoo from a built wheel: built from a source distribution of the repository (so both carry the
top-level configs/, which the build installs as sn_detection/configs, without a copy in the source), installed
into a folder of its own and imported from there, with the repository out of sight, it has every file of
configs/ and every catalog config and every LazyConfig loads; both carry the licence (LICENSE, Apache-2.0)."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile

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
    files = sorted(
        os.path.relpath(os.path.join(folder, name), model_zoo.CONFIG_DIR)
        for folder, _, names in os.walk(model_zoo.CONFIG_DIR)
        for name in names
        if "__pycache__" not in folder
    )
    print(json.dumps({"file": sn_detection.__file__, "config_dir": model_zoo.CONFIG_DIR, "files": files,
                      "yaml": yaml, "lazy": lazy, "path": [os.path.realpath(entry) for entry in sys.path]}))
    """
)


def _run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the source distribution of a copy of the repository, the wheel built from it, the folder it is
    installed into without dependencies)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    # a copy, so that setuptools' build/ and egg-info stay out of the checkout; only what a clone has
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "output")
    shutil.copytree(REPO, source, symlinks=True, ignore=ignore)
    sdists, wheels, target = tmp / "sdist", tmp / "wheels", tmp / "site"
    # the PEP 517 hook that `python -m build` calls first
    build_sdist = f"from setuptools import build_meta; build_meta.build_sdist({str(sdists)!r})"
    _run([sys.executable, "-c", build_sdist], cwd=source)
    assert not (source / "sn_detection" / "configs").exists()  # the build maps configs/, it copies nothing there
    (sdist,) = sdists.glob("sn_detection-*.tar.gz")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(sdist)])
    (wheel,) = wheels.glob("sn_detection-*.whl")
    _run(pip + ["install", "--no-deps", "--no-index", "--target", str(target), str(wheel)])
    return sdist, wheel, target


@pytest.fixture(scope="module")
def installed(built):
    return built[2]


def test_the_sdist_and_the_wheel_carry_the_licence(built):
    sdist, wheel, target = built
    with open(os.path.join(REPO, "LICENSE"), encoding="utf-8") as f:
        licence = f.read()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    with tarfile.open(sdist) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.split("/", 1)[1:] == ["LICENSE"]]
        assert archive.extractfile(member).read().decode() == licence
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        (licence_file,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
        assert archive.read(licence_file).decode() == licence
        headers = archive.read(metadata).decode().split("\n\n", 1)[0].splitlines()
    assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers
    installed_licence = target / licence_file
    assert installed_licence.read_text(encoding="utf-8") == licence  # pip installs it with the package


def test_the_wheel_serves_every_config_without_the_repository(installed, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)  # first on sys.path, before site-packages and its editable finder
    result = _run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env)
    loaded = json.loads(result.stdout.strip().splitlines()[-1])

    assert os.path.commonpath([loaded["file"], str(installed)]) == str(installed), loaded["file"]
    assert loaded["config_dir"] == str(installed / "sn_detection" / "configs")
    assert os.path.realpath(REPO) not in loaded["path"]
    # every config file of the repository's configs/ (yaml, the LazyConfigs' .py), and nothing else
    configs = os.path.join(REPO, "configs")
    in_repository = [
        os.path.relpath(os.path.join(folder, name), configs)
        for folder, _, names in os.walk(configs)
        for name in names
        if name.endswith((".yaml", ".py"))
    ]
    assert loaded["files"] == sorted(in_repository)

    # the norms of each config, as the catalog has them (the backbone's; the FPN's is the head's)
    assert set(loaded["yaml"]) == set(model_zoo.names())
    for entry in model_zoo.CATALOG:
        backbone, fpn = loaded["yaml"][entry.name]
        assert backbone == entry.backbone, entry.name
        if entry.setting != 1:  # setting 1 (C4) has no FPN
            assert fpn == entry.head, entry.name
    assert loaded["lazy"] == {
        "demo_mask_rcnn_sn": "SN",
        "mask_rcnn_dn_2x": "DN",
        "mask_rcnn_gn_lsj_100ep": "GN",
        "mask_rcnn_mgn_2x": "MGN",
        "mask_rcnn_sn_2x": "SN",
        "mask_rcnn_sn_lsj_100ep": "SyncSN",
        "mask_rcnn_ssn_2x": "SSN",
    }
    assert tuple(loaded["lazy"]) == model_zoo.lazy_names()


def test_rendering_from_the_wheel_says_it_needs_a_checkout(installed, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    result = subprocess.run(
        [sys.executable, "-m", "sn_detection.model_zoo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "run this from a checkout" in result.stderr
