"""The authors' Switchable Normalization ImageNet checkpoints (switchablenorms/Switchable-Normalization).

Layout. A ``torch.save``d dict whose ``"state_dict"`` is the model's state dict (their trainer also
stores ``epoch``, ``model`` -- the architecture's name, e.g. ``resnetv1sn50`` --, ``best_prec1`` and
``optimizer``; a bare state dict is accepted too). Keys carry the ``module.`` prefix of
``DataParallel`` / ``DistributedDataParallel`` when the model was wrapped, and follow torchvision's
ResNet with ``sn`` where torchvision has ``bn``:

    conv1.weight, sn1.*                                   the stem
    layerK.i.conv{1,2,3}.weight, layerK.i.sn{1,2,3}.*     block i of stage K (K = 1..4 -> res2..res5)
    layerK.i.downsample.0.weight, layerK.i.downsample.1.* the projection shortcut and its SN
    fc.weight, fc.bias                                    the classifier (dropped)

Each ``SwitchNorm2d`` holds ``weight`` and ``bias`` of shape (1, C, 1, 1), the logits ``mean_weight``
and ``var_weight`` (3 values ordered [IN, LN, BN], or 2 [IN, LN] when trained without the BN branch,
``using_bn=False``), stored before the softmax, and, with the BN branch, ``running_mean`` and
``running_var`` of shape (1, C, 1). They become ``SwitchableNorm2d``'s (C,) parameters and buffers;
logits stay logits. The stride of a downsampling block is in its 3x3 conv (STRIDE_IN_1X1 False).

What the stored statistics are, and how they differ from this package's layer. The authors' layer
computes the per-instance variance over H*W with ``Tensor.var``, i.e. *unbiased* (divided by
H*W - 1), and derives the BN-branch statistics from it, var_bn = mean_n(var_in + mu_in^2) - mu_bn^2.
``running_var`` is a moving average of that var_bn (their momentum 0.9 keeps 0.9 of the old value) or,
in "batch average" models, its average over 200 training batches, stored after each epoch. Either way
it is copied unchanged. ``SwitchableNorm2d`` uses the biased variance throughout, so at test time the
converted network differs from the authors' by a factor H*W / (H*W - 1) on the IN variance and on the
matching part of the LN and stored BN variances: about 2% at a 7x7 map, 0.5% at 14x14, negligible at
detection resolutions. ``num_batches_tracked``, which the authors' layer lacks, starts at 0.
"""

from collections.abc import Mapping

from .files import load_torch_file
from .report import ConversionError, ConversionReport
from .resnet import ResNetCollector
from .torchvision_resnet import TorchvisionNames, collect

SOURCE_NORM = "SN"
EXPECTED_LAYOUT = (
    "a torch.save'd dict with 'state_dict' (or a bare state dict) holding conv1.weight, "
    "sn1.{weight,bias,mean_weight,var_weight,running_mean,running_var}, layerK.i.conv{1,2,3}.weight, "
    "layerK.i.sn{1,2,3}.*, layerK.i.downsample.{0.weight,1.*}, optionally prefixed by 'module.'"
)
# the terms of the weights, which the converter prints beside the file it writes (docs/pretrained_weights.md)
WEIGHTS_TERMS = (
    "the SN authors' ImageNet weights: the README of their repository "
    "(https://github.com/switchablenorms/Switchable-Normalization) releases all its materials under CC BY-NC 4.0 "
    "(attribution, non-commercial: https://creativecommons.org/licenses/by-nc/4.0/). This file is converted from "
    "them: check that licence before using it, or a detector finetuned from it, for anything commercial."
)

NAMES_PARAMS = ("weight", "bias", "mean_weight", "var_weight", "running_mean", "running_var")
NAMES = TorchvisionNames("sn", NAMES_PARAMS)


def load(path: str) -> Mapping:
    """The state dict inside an SN ImageNet checkpoint file (keys as stored)."""
    checkpoint = load_torch_file(path)
    state = checkpoint.get("state_dict", checkpoint)
    if not isinstance(state, Mapping):
        raise ConversionError(
            f"{path}: 'state_dict' is a {type(state).__name__}, not a dict; expected {EXPECTED_LAYOUT}"
        )
    return state


def convert(state: Mapping, norm: str = "SN") -> tuple[dict, ConversionReport]:
    """detectron2 ResNet keys for ``state`` (the authors' layout, see the module docstring)."""
    report = ConversionReport(source="sn")
    sparse = next((key for key in state if isinstance(key, str) and key.endswith((".mean_fixed", ".radius"))), None)
    if sparse is not None:  # SN would read its one-hot logits through a softmax
        raise ConversionError(f"{sparse} is a buffer of Sparse Switchable Normalization: convert it with --source ssn")
    collector = ResNetCollector(SOURCE_NORM, NAMES.source_key, report)
    collect(state, NAMES, collector, _skip_reason)
    return collector.build(norm), report


def _skip_reason(name: str) -> str:
    return "the classifier" if name in ("fc.weight", "fc.bias") else "not part of the SN ResNet layout"
