"""The network of pretraining: detectron2's ResNet of a detection config -- stem and res2-res5 exactly as
detectron2 builds them for that detector, our norms with the config's options (``SNMetaArch``'s
``resolve_norms``) -- a global average pool and a linear classifier; and the backbone checkpoint it
leaves, which the detection config loads with no conversion and no missing backbone keys.

The checkpoint holds the bare ResNet keys (``stem.conv1.weight``, ``res2.0.conv1.norm.weight``, ...) with
detectron2's matching heuristics, so it loads into FPN (``backbone.bottom_up.*``) and C4 models alike
(``conversion.files``). BatchNorm's ``num_batches_tracked`` is left out: a training counter, which
FrozenBN (the usual norm of a finetuned BN backbone) does not have and BatchNorm only reads with momentum
None. The input convention is the config's: images in INPUT.FORMAT, (pixels - PIXEL_MEAN) / PIXEL_STD,
the stride where STRIDE_IN_1X1 puts it; ``input_convention`` says it in the converter's terms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from detectron2.config import CfgNode
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone.resnet import build_resnet_backbone
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..conversion import InputConvention
from ..d2.config import validate_sn_config
from ..d2.meta_arch import resolve_norms
from ..layers import NORM_NAMES, RunningMoments, norm_class
from .config import validate_pretrain_config

# The norm a detection backbone's norm is pretrained as: FrozenBN (the paper's BN-dagger, a finetuned BN
# backbone) is BN with fixed statistics and affine, which only BN can learn; its keys are BN's.
PRETRAINED_AS = {"FrozenBN": "BN"}
# PRETRAIN.SYNC_NORMS: the norm names whose batch statistics then pool over all processes
SYNCED_NAMES = {"SN": "SyncSN", "SSN": "SyncSSN", "BN": "SyncBN"}


def backbone_cfg(cfg: CfgNode) -> CfgNode:
    """The config of the backbone to pretrain: res5 out, nothing frozen, the norm it is pretrained as,
    synchronised if asked."""
    validate_sn_config(cfg)
    validate_pretrain_config(cfg)
    backbone = cfg.clone()
    backbone.defrost()
    backbone.MODEL.RESNETS.OUT_FEATURES = ["res5"]
    backbone.MODEL.BACKBONE.FREEZE_AT = 0
    norm = pretrained_norm(cfg)
    backbone.MODEL.RESNETS.NORM = synced_norm(norm, cfg.MODEL.DEVICE) if cfg.PRETRAIN.SYNC_NORMS else norm
    return backbone


def pretrained_norm(cfg: CfgNode) -> str:
    """The norm that pretraining trains for the config's backbone norm (``PRETRAINED_AS``)."""
    return PRETRAINED_AS.get(cfg.MODEL.RESNETS.NORM, cfg.MODEL.RESNETS.NORM)


def synced_norm(norm: str, device: str) -> str:
    """``norm`` with its batch statistics pooled over all processes (PRETRAIN.SYNC_NORMS); a norm of
    batch statistics that cannot be pooled is refused (each process would silently use its own)."""
    synced = SYNCED_NAMES.get(norm, norm)
    if synced in NORM_NAMES and issubclass(norm_class(synced), RunningMoments) and synced not in SYNCED_NAMES.values():
        raise ValueError(
            f"PRETRAIN.SYNC_NORMS=True: {norm} has batch statistics that no synchronised layer pools; "
            f"only {', '.join(SYNCED_NAMES)} have one ({', '.join(SYNCED_NAMES.values())}). Set PRETRAIN.SYNC_NORMS "
            f"False to pretrain {norm} with each process's own batch statistics"
        )
    if synced == "SyncBN" and torch.device(device).type != "cuda":
        raise ValueError(
            f"PRETRAIN.SYNC_NORMS=True makes BN torch's SyncBatchNorm, which runs on CUDA only, but MODEL.DEVICE "
            f"is {device!r}; on the CPU, SN synchronises (SyncSN, over gloo), or set PRETRAIN.SYNC_NORMS False"
        )
    return synced


class BackboneClassifier(nn.Module):
    """detectron2's ResNet of ``cfg``, global average pooling, a linear classifier over ``num_classes``.

    Input: a batch (uint8 images (B, 3, S, S) in INPUT.FORMAT, labels); in training the output is
    detectron2's loss dict, {"loss_cls": cross-entropy with PRETRAIN.LABEL_SMOOTHING}, else the logits."""

    def __init__(self, cfg: CfgNode, num_classes: int):
        super().__init__()
        self.backbone = build_resnet_backbone(resolve_norms(backbone_cfg(cfg)), ShapeSpec(channels=3))
        self.register_buffer("pixel_mean", torch.tensor(cfg.MODEL.PIXEL_MEAN).view(3, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor(cfg.MODEL.PIXEL_STD).view(3, 1, 1), False)
        self.classifier = nn.Linear(self.backbone.output_shape()["res5"].channels, num_classes)
        nn.init.normal_(self.classifier.weight, std=0.01)
        nn.init.zeros_(self.classifier.bias)
        self.label_smoothing = cfg.PRETRAIN.LABEL_SMOOTHING

    def forward(self, batch):
        images, labels = batch
        logits = self.logits(images.to(self.pixel_mean.device))
        if not self.training:
            return logits
        return {"loss_cls": F.cross_entropy(logits, labels.to(logits.device), label_smoothing=self.label_smoothing)}

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.float() - self.pixel_mean) / self.pixel_std
        return self.classifier(self.backbone(x)["res5"].mean((2, 3)))


def backbone_state(classifier: BackboneClassifier) -> dict[str, torch.Tensor]:
    """The backbone's tensors under their bare ResNet keys, without BatchNorm's counter (module docstring)."""
    counters = {
        f"{name}.num_batches_tracked"
        for name, module in classifier.backbone.named_modules()
        if isinstance(module, _BatchNorm)
    }
    return {
        key: value.detach().cpu().clone()
        for key, value in classifier.backbone.state_dict().items()
        if key not in counters
    }


def input_convention(cfg: CfgNode) -> InputConvention:
    """How a detector must feed the pretrained backbone: the config's own input settings."""
    return InputConvention(
        pixel_mean=tuple(cfg.MODEL.PIXEL_MEAN),
        pixel_std=tuple(cfg.MODEL.PIXEL_STD),
        stride_in_1x1=cfg.MODEL.RESNETS.STRIDE_IN_1X1,
        input_format=cfg.INPUT.FORMAT,
    )
