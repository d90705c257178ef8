"""A folder of generated files that is either complete and intact, or regenerated.

A split is written into a temporary sibling folder and renamed into place only once complete, with a
manifest of every file's size and SHA-256 written last. A folder whose manifest is missing, describes
other generation arguments, or disagrees with the files (a killed run, a truncated or edited file) is
removed and generated again (so is a file or link in its place). The temporary folder's name holds the
writing process's id; one left behind by a process that no longer runs (killed before it could clean up)
is removed by the next writer of the same folder, so a cache of backbones does not fill the disk.

Every generated dataset lives under one data root, ``data_root()``: ``$SN_DETECTION_DATA``, by default
``~/.cache/sn_detection/datasets``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable

MANIFEST = "manifest.json"

DEFAULT_DATA_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "sn_detection", "datasets")


def data_root() -> str:
    """Where generated datasets are cached: ``$SN_DETECTION_DATA``, else ``DEFAULT_DATA_ROOT``."""
    return os.environ.get("SN_DETECTION_DATA", DEFAULT_DATA_ROOT)


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _list_files(folder: str) -> dict[str, dict]:
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            relative = os.path.relpath(path, folder)
            if relative != MANIFEST:
                files[relative] = {"bytes": os.path.getsize(path), "sha256": _digest(path)}
    return files


def is_intact(folder: str, key: dict) -> bool:
    """Whether folder holds exactly the files its manifest lists, generated with arguments `key`."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return manifest.get("key") == key and manifest.get("files") == _list_files(folder)


def _remove(path: str) -> None:
    """Remove a damaged folder, or whatever else (a file, a link) took its name."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_abandoned(folder: str) -> None:
    """Remove the temporary siblings of `folder` whose writing process no longer runs."""
    parent, prefix = os.path.dirname(folder), f".{os.path.basename(folder)}."
    for name in os.listdir(parent):
        pid = name[len(prefix) :].split(".", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not _process_runs(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def ensure_folder(folder: str, key: dict, generate: Callable[[str], None]) -> str:
    """Returns `folder`, first (re)generating it with `generate(tmp_folder)` unless it is intact."""
    if is_intact(folder, key):
        return folder
    folder = os.path.abspath(folder)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    _remove_abandoned(folder)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.{os.getpid()}.", dir=parent)
    try:
        generate(tmp)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"key": key, "files": _list_files(tmp)}, f)
        if os.path.lexists(folder) and not is_intact(folder, key):
            _remove(folder)
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process finished the same folder first; theirs is as good as ours.
            if not is_intact(folder, key):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
