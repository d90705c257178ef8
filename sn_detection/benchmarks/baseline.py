"""The norm layers of another commit of this checkout, imported beside its own, so that a benchmark times the
two side by side in one process (``--baseline REF`` of tools/benchmark_norms.py, count_launches.py
--host-time and benchmark_train.py): the same machine, the same load, interleaved rounds.

``sn_detection/layers`` is pure PyTorch and imports only itself (relative imports), so the commit's copy,
extracted with ``git archive`` into a temporary folder under the name ``sn_layers_<commit>``, imports as a
package of its own. ``baseline_twin`` builds, for a layer of this checkout, the same class of the baseline
with the same options and state (the identity in the state dict names the class and its options, which
the two share as long as the baseline's layers are this project's).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
from types import ModuleType

from torch import nn

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # sn_detection
_imported: dict = {}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", _PACKAGE, *args], capture_output=True, check=False)


def baseline_layers(ref: str) -> tuple[str, ModuleType]:
    """(label, package): the ``sn_detection.layers`` package of commit ``ref`` of the checkout this package is
    in, and the label its rows get (``@`` and 9 digits of the commit). Raises ValueError when this package is
    not in a git checkout or ``ref`` names no commit there."""
    found = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if found.returncode != 0:
        where = _git("rev-parse", "--show-toplevel")
        if where.returncode != 0:
            raise ValueError(f"--baseline {ref}: {_PACKAGE} is not in a git checkout, so no other commit can be read")
        raise ValueError(f"--baseline {ref}: no such commit in {where.stdout.decode().strip()}")
    commit = found.stdout.decode().strip()
    label = f"@{commit[:9]}"
    if commit not in _imported:
        _imported[commit] = (label, _import_layers(commit))
    return _imported[commit]


def _import_layers(commit: str) -> ModuleType:
    # run in the package's folder, git archive takes and names the paths relative to it: layers/...
    archive = _git("archive", "--format=tar", commit, "layers")
    if archive.returncode != 0:
        raise ValueError(f"--baseline {commit[:12]}: it has no sn_detection/layers ({archive.stderr.decode().strip()})")
    folder = tempfile.mkdtemp(prefix="sn_baseline_")
    path = os.path.join(folder, "archive.tar")
    with open(path, "wb") as f:
        f.write(archive.stdout)
    with tarfile.open(path) as tar:
        # the data filter where Python has it (3.10.12 and later): plain files and folders only
        tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    name = f"sn_layers_{commit[:12]}"
    os.rename(os.path.join(folder, "layers"), os.path.join(folder, name))
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def baseline_twin(package: ModuleType, layer: nn.Module) -> nn.Module:
    """The baseline ``package``'s layer of ``layer``'s class, with its channel count, options and state,
    on its device."""
    cls = getattr(package, type(layer).__name__, None)
    if cls is None:
        raise ValueError(f"the baseline has no {type(layer).__name__}")
    options = {name: getattr(layer, name) for name in cls.option_rules}
    twin = cls(layer.num_channels, **options)
    twin.load_state_dict(layer.state_dict())
    reference = next(iter(layer.parameters()))
    return twin.to(reference.device).train(layer.training)


def with_baseline_norms(package: ModuleType, model: nn.Module, *, norm_base: type) -> nn.Module:
    """``model`` (changed in place) with every layer of this checkout's ``norm_base`` replaced by its baseline
    twin (``baseline_twin``); returns it."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, norm_base):
                setattr(module, child_name, baseline_twin(package, child))
    return model
