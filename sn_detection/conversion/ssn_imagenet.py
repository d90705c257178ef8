"""The authors' Sparse Switchable Normalization ImageNet checkpoints (switchablenorms/Sparse_SwitchNorm).

Layout. As the SN authors' checkpoints (``sn_imagenet``): their trainer's ``torch.save``d dict with
``"state_dict"`` (a bare state dict is accepted too), keys with the ``module.`` prefix of
``DistributedDataParallel`` and torchvision's ResNet names with ``sn`` where torchvision has ``bn``
(``sn1.*``, ``layerK.i.sn{1,2,3}.*``, ``layerK.i.downsample.1.*``); the classifier ``fc.*`` is dropped. Each
``SSN2d`` holds

    weight, bias                  (1, C, 1, 1)
    mean_weight, var_weight       (3,) logits [IN, LN, BN], or (2,) without the BN branch
    running_mean, running_var     (1, C, 1), with the BN branch
    mean_fixed, var_fixed         (1,) int64: 1 once the weights were fixed, else 0
    radius                        (1,) float: SparsestMax's radius when the file was saved

When their layer fixes a weight vector it also overwrites its logits with the one-hot values [1, 0, 0] of the
chosen branch, so the chosen branch is the largest logit. They become ``SparseSwitchableNorm2d``'s tensors:
the (C,) affine and running statistics, the logits as they are, the radius as a scalar, and ``mean_fixed``
(``var_fixed``) the chosen branch where the flag is 1, else -1. ``mean_fixed_at``, ``var_fixed_at`` and
``iteration`` are unknown (-1), ``num_batches_tracked`` starts at 0. The stride of a downsampling block is in
its 3x3 conv, and the input the one of the SN authors' trainer (``conventions``).

What the stored statistics are: as in the SN authors' layer, the per-instance variance is ``Tensor.var``'s,
unbiased, and the BN branch's statistics derive from it (their momentum 0.997 keeps 0.997 of the old value);
``running_var`` is copied unchanged. ``SparseSwitchableNorm2d`` uses the biased variance throughout, so the
converted network differs from theirs by the factor H*W / (H*W - 1) on the IN variance and the matching part
of the others (``sn_imagenet``; docs/pretrained_weights.md).

Weights that are not fixed in a file compute SparsestMax at the stored radius here. (The authors' evaluation
script computes them at radius 0, a Python attribute that starts at 0 when the model is built, rather than
the buffer; by the end of their schedule r has passed sqrt(2/3), from where every weight vector is one-hot
and fixed, so a final model has none.) The report counts the layers that are not fixed.
"""

from collections.abc import Mapping

import torch

from . import sn_imagenet
from .report import ConversionError, ConversionReport
from .resnet import ResNetCollector
from .torchvision_resnet import TorchvisionNames, collect

SOURCE_NORM = "SSN"
EXPECTED_LAYOUT = (
    "a torch.save'd dict with 'state_dict' (or a bare state dict) holding conv1.weight, "
    "sn1.{weight,bias,mean_weight,var_weight,running_mean,running_var,mean_fixed,var_fixed,radius}, "
    "layerK.i.conv{1,2,3}.weight, layerK.i.sn{1,2,3}.*, layerK.i.downsample.{0.weight,1.*}, optionally prefixed "
    "by 'module.'"
)

_FLAGS = {"mean_fixed": "mean_weight", "var_fixed": "var_weight"}  # a flag and the logits it fixes
NAMES = TorchvisionNames("sn", sn_imagenet.NAMES_PARAMS + ("mean_fixed", "var_fixed", "radius"))
# the terms of the weights, which the converter prints beside the file it writes (docs/pretrained_weights.md)
WEIGHTS_TERMS = (
    "the SSN authors' ImageNet weights: their repository (https://github.com/switchablenorms/Sparse_SwitchNorm) "
    "names no licence, in its README or in a licence file, so no one is granted any right to them beyond what "
    "the law allows: ask the authors before using this file, or a detector finetuned from it, outside research."
)

load = sn_imagenet.load


def convert(state: Mapping, norm: str = "SSN") -> tuple[dict, ConversionReport]:
    """detectron2 ResNet keys for ``state`` (the authors' layout, see the module docstring)."""
    report = ConversionReport(source="ssn")
    collector = ResNetCollector(SOURCE_NORM, NAMES.source_key, report)
    state, free = _fixed_branches(state)
    collect(state, NAMES, collector, _skip_reason)
    converted = collector.build(norm)
    layers = sum(key.endswith(".norm.mean_fixed") for key in converted)
    if free:
        report.notes.append(
            f"{free} of the {2 * layers} weight vectors of the SSN layers are not fixed: they compute SparsestMax at "
            "the stored radius (module docstring)"
        )
    return converted, report


def _fixed_branches(state: Mapping) -> tuple[dict, int]:
    """``state`` with each 0/1 flag ``P.mean_fixed`` (``P.var_fixed``) replaced by the branch it fixed, the
    largest of the logits ``P.mean_weight``, or -1; and how many flags are 0. A flag that is not a single 0 or
    1, or whose logits are missing, is left for the collector to report."""
    state, free = dict(state), 0
    for key, flag in list(state.items()):
        name = key.rsplit(".", 1)[-1]
        logits = state.get(key[: -len(name)] + _FLAGS[name]) if name in _FLAGS else None
        if not (isinstance(flag, torch.Tensor) and isinstance(logits, torch.Tensor)) or flag.numel() != 1:
            continue
        if int(flag.reshape(())) not in (0, 1):
            raise ConversionError(f"{key} is {int(flag.reshape(()))}: a fixed flag is 0 or 1")
        fixed = bool(flag.reshape(()))
        free += not fixed
        branch = int(logits.reshape(-1).argmax()) if fixed else -1
        state[key] = torch.tensor(branch, dtype=torch.int64)
    return state, free


def _skip_reason(name: str) -> str:
    return "the classifier" if name in ("fc.weight", "fc.bias") else "not part of the SSN ResNet layout"
