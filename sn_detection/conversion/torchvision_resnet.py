"""torchvision's ImageNet ResNets (``torchvision.models.resnet50`` and its siblings), trained with BN.

Layout. A bare ``torch.save``d state dict (a ``{"state_dict": ...}`` or ``{"model": ...}`` wrapper
and a ``module.`` prefix are accepted too):

    conv1.weight, bn1.*                                   the stem
    layerK.i.conv{1,2,3}.weight, layerK.i.bn{1,2,3}.*     block i of stage K (K = 1..4 -> res2..res5)
    layerK.i.downsample.0.weight, layerK.i.downsample.1.* the projection shortcut and its BN
    fc.weight, fc.bias                                    the classifier (dropped)

with BN's weight, bias, running_mean, running_var (and num_batches_tracked, a training counter, dropped)
of shape (C,). The stride of a downsampling block is in its 3x3 conv (STRIDE_IN_1X1 False).

The output norm (``norm``):

- ``BN`` (default): the four BN tensors, for detectron2's FrozenBN (or BN / SyncBN) backbones.
- ``SN``: ``SwitchableNorm2d`` with gamma, beta from BN's weight and bias and the BN branch's running
  statistics from BN's running_mean and running_var; the logits ``mean_weight``, ``var_weight`` and
  ``num_batches_tracked`` keep ``SwitchableNorm2d``'s initialisation (equal logits: IN, LN and BN
  weighted 1/3 each), so the network starts as a different function from the BN one and is meant to
  be fine-tuned. torchvision's running_var is BN's unbiased estimate while SN's buffer holds a biased
  one: a factor n / (n - 1) over ImageNet batch statistics, i.e. none in practice.
- ``GN``: ``GroupNorm2d`` (detectron2's ``GN``) with gamma, beta from BN's weight and bias; BN's running
  statistics have no place in GN and are skipped.
"""

import re
from collections.abc import Callable, Mapping

import torch

from .files import load_torch_file
from .report import ConversionReport
from .resnet import ResNetCollector

SOURCE_NORM = "BN"
EXPECTED_LAYOUT = (
    "a torch.save'd state dict holding conv1.weight, bn1.{weight,bias,running_mean,running_var}, "
    "layerK.i.conv{1,2,3}.weight, layerK.i.bn{1,2,3}.*, layerK.i.downsample.{0.weight,1.*}"
)
# the terms of the weights, which the converter prints beside the file it writes (docs/pretrained_weights.md)
WEIGHTS_TERMS = (
    "torchvision's ImageNet weights: torchvision names no licence for its ResNet weights; its README says its "
    "pre-trained models may have their own licenses or terms derived from the dataset used for training, and that "
    "it is the "
    "user's responsibility to determine whether they have permission to use them. Its ResNets were trained on "
    "ImageNet-1k, whose terms of access allow the use of the database only for non-commercial research and "
    "educational purposes. This file is converted from them: check both before using it outside research."
)


class TorchvisionNames:
    """torchvision's ResNet key names (without ``module.``) <-> detectron2 (module, param) pairs.

    ``norm`` is the name torchvision's norm modules have (``bn``; the SN authors renamed them ``sn``)
    and ``params`` the norm parameters the layout may hold.
    """

    def __init__(self, norm: str, params: tuple[str, ...]):
        self.norm = norm
        names = "|".join(params)
        self._stem = re.compile(rf"conv1\.weight|{norm}1\.({names})")
        self._block = re.compile(
            rf"layer([1-4])\.(\d+)\.(?:conv([123])\.weight|{norm}([123])\.({names})"
            rf"|downsample\.0\.weight|downsample\.1\.({names}))"
        )

    def detectron2_name(self, name: str) -> tuple[str, str] | None:
        """(detectron2 module, param) for a key of this layout, or None if it is not a backbone key."""
        if match := self._stem.fullmatch(name):
            return "stem.conv1", f"norm.{match.group(1)}" if match.group(1) else "weight"
        match = self._block.fullmatch(name)
        if match is None:
            return None
        stage, block, conv, norm_index, norm_param, shortcut_param = match.groups()
        prefix = f"res{int(stage) + 1}.{block}"
        if conv:
            return f"{prefix}.conv{conv}", "weight"
        if norm_index:
            return f"{prefix}.conv{norm_index}", f"norm.{norm_param}"
        return f"{prefix}.shortcut", f"norm.{shortcut_param}" if shortcut_param else "weight"

    def source_key(self, module: str, param: str) -> str:
        """This layout's key for a detectron2 module's parameter."""
        norm_param = param.removeprefix("norm.")
        if module == "stem.conv1":
            return "conv1.weight" if param == "weight" else f"{self.norm}1.{norm_param}"
        stage, block, conv = module.split(".")
        prefix = f"layer{int(stage[3:]) - 1}.{block}"
        if conv == "shortcut":
            return f"{prefix}.downsample.0.weight" if param == "weight" else f"{prefix}.downsample.1.{norm_param}"
        return f"{prefix}.{conv}.weight" if param == "weight" else f"{prefix}.{self.norm}{conv[4]}.{norm_param}"


NAMES = TorchvisionNames("bn", ("weight", "bias", "running_mean", "running_var"))


def load(path: str) -> Mapping:
    """The state dict in a torchvision ResNet file (keys as stored)."""
    state = load_torch_file(path)
    for wrapper in ("state_dict", "model"):
        if isinstance(state.get(wrapper), Mapping):
            state = state[wrapper]
    return state


def convert(state: Mapping, norm: str = "BN") -> tuple[dict, ConversionReport]:
    """detectron2 ResNet keys for ``state`` (torchvision's layout, see the module docstring)."""
    report = ConversionReport(source="torchvision")
    collector = ResNetCollector(SOURCE_NORM, NAMES.source_key, report)
    collect(state, NAMES, collector, _skip_reason)
    if norm == "SN":
        report.notes.append("SN logits keep SwitchableNorm2d's initialisation (equal weights): fine-tune")
    return collector.build(norm), report


def collect(state: Mapping, names: TorchvisionNames, collector: ResNetCollector, skip_reason: Callable) -> None:
    """Hand every backbone tensor of ``state`` to ``collector``; report the rest as skipped."""
    report = collector.report
    for key, value in state.items():
        target = names.detectron2_name(key.removeprefix("module."))
        if target is None:
            report.skipped.append((key, skip_reason(key.removeprefix("module."))))
        elif not isinstance(value, torch.Tensor):
            report.mismatched.append((key, f"a {type(value).__name__}, not a tensor"))
        else:
            collector.add(*target, key, value)


def _skip_reason(name: str) -> str:
    if name in ("fc.weight", "fc.bias"):
        return "the classifier"
    if name.endswith(".num_batches_tracked"):
        return "BN's training counter"
    return "not part of the torchvision ResNet layout"
