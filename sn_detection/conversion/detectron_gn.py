"""Detectron's (Caffe2) Group Normalization ImageNet ResNets: ``R-50-GN.pkl``, ``R-101-GN.pkl``.

Layout. A Python 2 pickle (read with latin1) of ``{"blobs": {name: numpy array}}`` -- ImageNet files
may also be the bare blob dict -- with Caffe2's blob names:

    conv1_w, conv1_gn_s, conv1_gn_b                        the stem conv and its GN scale and bias
    res{2..5}_{i}_branch2{a,b,c}_w, ..._gn_s, ..._gn_b     block i's three convs and their GN
    res{2..5}_{i}_branch1_w, ..._gn_s, ..._gn_b            the projection shortcut
    fc1000_w, fc1000_b                                     the classifier (dropped)
    <blob>_momentum                                        SGD momentum buffers (dropped)

mapped as detectron2's own Caffe2 renaming does (``detectron2/checkpoint/c2_model_loading.py``):
branch2a/2b/2c -> conv1/conv2/conv3, branch1 -> shortcut, gn_s -> norm.weight, gn_b -> norm.bias, conv1
-> stem.conv1. Detectron's GN has 32 groups, detectron2's ``GN`` too. The convs have no bias. Stride
is in the 3x3 conv (STRIDE_IN_1X1 False); the input is BGR with unit std (see ``conventions``).

detectron2 can also load such a pickle directly as ``MODEL.WEIGHTS`` (it renames Caffe2 blobs itself);
converting first checks the file against the architecture, reports what was dropped and gives a file
in the same format as the other sources.
"""

import re
from collections.abc import Mapping

from torch import Tensor, as_tensor

from .files import load_pickle
from .report import ConversionReport
from .resnet import ResNetCollector

SOURCE_NORM = "GN"
EXPECTED_LAYOUT = (
    "a pickle of {'blobs': {name: numpy array}} (or the bare blob dict) with Caffe2 names conv1_w, "
    "conv1_gn_s, conv1_gn_b, res{2-5}_{i}_branch{2a,2b,2c,1}_{w,gn_s,gn_b}"
)
# the terms of the weights, which the converter prints beside the file it writes (docs/pretrained_weights.md)
WEIGHTS_TERMS = (
    "Detectron's GN ImageNet weights: detectron2's MODEL_ZOO.md lists R-50-GN.pkl and R-101-GN.pkl and states "
    "that all models available for download through it are licensed under CC BY-SA 3.0 (attribution, "
    "share-alike: https://creativecommons.org/licenses/by-sa/3.0/). This file is converted from them: check "
    "that licence's attribution and share-alike terms for what you distribute."
)

_BLOB = re.compile(r"(?:conv1|res([2-5])_(\d+)_branch(2a|2b|2c|1))_(w|gn_s|gn_b)")
_CONVS = {"2a": "conv1", "2b": "conv2", "2c": "conv3", "1": "shortcut"}
_PARAMS = {"w": "weight", "gn_s": "norm.weight", "gn_b": "norm.bias"}


def load(path: str) -> Mapping:
    """The blob dict of a Detectron pickle (names as stored, values as stored)."""
    data = load_pickle(path)
    return data["blobs"] if isinstance(data.get("blobs"), Mapping) else data


def convert(blobs: Mapping, norm: str = "GN") -> tuple[dict, ConversionReport]:
    """detectron2 ResNet keys for Detectron GN ``blobs`` (see the module docstring)."""
    report = ConversionReport(source="gn")
    collector = ResNetCollector(SOURCE_NORM, source_key, report)
    for name, value in blobs.items():
        target = _detectron2_name(name) if isinstance(name, str) else None
        tensor = _tensor(value)
        if target is None:
            report.skipped.append((str(name), _skip_reason(str(name))))
        elif tensor is None:
            report.mismatched.append((name, f"a {type(value).__name__}, not an array"))
        else:
            collector.add(*target, name, tensor)
    return collector.build(norm), report


def _detectron2_name(name: str) -> tuple[str, str] | None:
    match = _BLOB.fullmatch(name)
    if match is None:
        return None
    stage, block, branch, param = match.groups()
    module = f"res{stage}.{block}.{_CONVS[branch]}" if stage else "stem.conv1"
    return module, _PARAMS[param]


def source_key(module: str, param: str) -> str:
    """Detectron's blob name for a detectron2 module's parameter (GN params: weight, bias)."""
    suffix = {"weight": "w", "norm.weight": "gn_s", "norm.bias": "gn_b"}.get(param, param)
    if module == "stem.conv1":
        return f"conv1_{suffix}"
    stage, block, conv = module.split(".")
    branch = {value: key for key, value in _CONVS.items()}[conv]
    return f"{stage}_{block}_branch{branch}_{suffix}"


def _tensor(value) -> Tensor | None:
    """A tensor owning a copy of a numpy array's data (or the tensor itself); None for other values."""
    if isinstance(value, Tensor):
        return value
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        return as_tensor(value.copy())
    return None


def _skip_reason(name: str) -> str:
    if name.endswith("_momentum"):
        return "SGD momentum"
    if name.startswith("fc1000_"):
        return "the classifier"
    return "not part of the Detectron GN ResNet layout"
