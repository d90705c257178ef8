"""The one table of source formats, and ``convert_file``: read a source file, convert, explain failures.

When a file does not have the requested source's layout, the error names what is missing, the layout
that was expected and, when the keys look like another known layout, which ``--source`` fits them.
"""

import re
from collections.abc import Mapping
from types import ModuleType

from . import detectron_gn, sn_imagenet, ssn_imagenet, torchvision_resnet
from .report import ConversionError, ConversionReport
from .resnet import TARGETS_OF_SOURCE_NORM

SOURCES: dict[str, ModuleType] = {
    "sn": sn_imagenet,
    "ssn": ssn_imagenet,
    "torchvision": torchvision_resnet,
    "gn": detectron_gn,
}

# (pattern over a file's keys, what such a file is) for naming the layout of a wrong-kind file; the first
# pattern that a key matches names it
_LAYOUT_SIGNS = (
    (
        re.compile(r"^Conv_Body\.(conv_body\.)?res1\.sn1\."),
        (
            "the SN authors' detection code's copy of an SN ImageNet ResNet (Detectron.pytorch names, Conv_Body.*), "
            "which this converter does not read: convert the ImageNet checkpoint of their Switchable-Normalization "
            "model zoo"
        ),
    ),
    (re.compile(r"(^|\.)sn1\.mean_fixed$"), "an SSN ImageNet checkpoint (--source ssn)"),
    (re.compile(r"(^|\.)sn1\.mean_weight$"), "an SN ImageNet checkpoint (--source sn)"),
    (re.compile(r"(^|\.)bn1\.running_mean$"), "a torchvision BN ResNet (--source torchvision)"),
    (re.compile(r"^conv1_gn_s$"), "a Detectron GN pickle (--source gn)"),
    (re.compile(r"_bn_s$|^res_conv1_bn"), "a Detectron / Caffe2 BN (affine) pickle, which detectron2 loads directly"),
    (re.compile(r"^(__author__$|stem\.conv1\.|res[2-5]\.\d+\.|backbone\.)"), "a detectron2 checkpoint already"),
)


def weights_terms(source: str) -> str:
    """What is known of the terms of ``source``'s released weights, which a file converted from them inherits
    (printed beside the written file; docs/pretrained_weights.md)."""
    return _module(source).WEIGHTS_TERMS


def default_norm(source: str) -> str:
    """The norm a source's network was trained with, hence the default output norm."""
    return _module(source).SOURCE_NORM


def convert_file(source: str, path: str, norm: str | None = None) -> tuple[dict, ConversionReport]:
    """detectron2 ResNet keys (see ``resnet``) for the ``source`` checkpoint at ``path``, with norm
    ``norm`` (default: the source's own) and the report of every key; raises ConversionError."""
    module = _module(source)
    norm = norm or module.SOURCE_NORM
    if norm not in TARGETS_OF_SOURCE_NORM[module.SOURCE_NORM]:
        raise ConversionError(
            f"a {source!r} checkpoint ({module.SOURCE_NORM}) cannot initialise {norm} layers; "
            f"possible norms: {list(TARGETS_OF_SOURCE_NORM[module.SOURCE_NORM])}"
        )
    state = module.load(path)
    try:
        return module.convert(state, norm)
    except ConversionError as error:
        message = f"{path} does not have the {source!r} layout: {error}. Expected {module.EXPECTED_LAYOUT}"
        layout = _describe(state)
        if layout and f"--source {source})" not in layout:
            message += f". Its keys look like {layout}"
        raise ConversionError(message, error.report) from error


def _describe(state: Mapping) -> str:
    """Which known layout the keys of ``state``, or of a dict under its "model", look like ("" if none)."""
    keys = [key for key in state if isinstance(key, str)]
    if isinstance(state.get("model"), Mapping):
        keys += [key for key in state["model"] if isinstance(key, str)]
    for pattern, layout in _LAYOUT_SIGNS:
        if any(pattern.search(key) for key in keys):
            return layout
    return ""


def _module(source: str) -> ModuleType:
    if source not in SOURCES:
        raise ConversionError(f"unknown source {source!r}; known sources: {list(SOURCES)}")
    return SOURCES[source]
