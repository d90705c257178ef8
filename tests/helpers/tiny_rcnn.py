"""Tiny detectron2 R-CNNs with our norms, a synthetic batch and one training step, for the d2 tests.

The models are stock R50 Mask R-CNN FPN and Faster R-CNN C4 built by detectron2's own builders, narrowed
(16-channel stem, 8-channel bottleneck groups, 16-wide FPN and heads) and fed two 64x64 images, so one
model builds and trains a step in about a second on a CPU.
"""

import torch
from detectron2.config import get_cfg
from detectron2.structures import BitMasks, Boxes, Instances
from detectron2.utils.events import EventStorage

from sn_detection.d2 import add_sn_config, build_optimizer

IMAGE_SIZE = 64
# Module-name prefixes of the norms set by each config key.
FPN_PARTS = {
    "MODEL.RESNETS.NORM": "backbone.bottom_up.",
    "MODEL.FPN.NORM": "backbone.fpn_",
    "MODEL.ROI_BOX_HEAD.NORM": "roi_heads.box_head.",
    "MODEL.ROI_MASK_HEAD.NORM": "roi_heads.mask_head.",
}
C4_PARTS = {"MODEL.RESNETS.NORM": "backbone.", "MODEL.RESNETS.NORM (res5 head)": "roi_heads.res5."}
# Stages frozen by FREEZE_AT = 2.
FROZEN_PREFIXES = ("backbone.bottom_up.stem.", "backbone.bottom_up.res2.", "backbone.stem.", "backbone.res2.")


def tiny_cfg(norm: str = "", arch: str = "fpn", *opts):
    """A config with ``norm`` in every norm key that ``arch`` ("fpn" or "c4") uses, then ``opts``."""
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.merge_from_list(
        [
            "MODEL.META_ARCHITECTURE",
            "SNMetaArch",
            "MODEL.DEVICE",
            "cpu",
            "MODEL.BACKBONE.FREEZE_AT",
            2,
            "MODEL.RESNETS.DEPTH",
            50,
            "MODEL.RESNETS.NORM",
            norm,
            "MODEL.RESNETS.STEM_OUT_CHANNELS",
            16,
            "MODEL.RESNETS.WIDTH_PER_GROUP",
            8,
            "MODEL.RESNETS.RES2_OUT_CHANNELS",
            32,
            "MODEL.SN.GN_GROUPS",
            8,
            "MODEL.SN.DN_INIT_GROUPS",
            8,
            "MODEL.RPN.PRE_NMS_TOPK_TRAIN",
            200,
            "MODEL.RPN.POST_NMS_TOPK_TRAIN",
            20,
            "MODEL.RPN.BATCH_SIZE_PER_IMAGE",
            4096,  # every anchor: each FPN level gets a gradient
            "MODEL.ROI_HEADS.NUM_CLASSES",
            3,
            "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE",
            8,
            "SOLVER.BASE_LR",
            0.01,
        ]
    )
    if arch == "fpn":
        features = ["res2", "res3", "res4", "res5"]
        cfg.merge_from_list(
            [
                "MODEL.MASK_ON",
                True,
                "MODEL.BACKBONE.NAME",
                "build_resnet_fpn_backbone",
                "MODEL.RESNETS.OUT_FEATURES",
                features,
                "MODEL.FPN.IN_FEATURES",
                features,
                "MODEL.FPN.OUT_CHANNELS",
                16,
                "MODEL.FPN.NORM",
                norm,
                "MODEL.ANCHOR_GENERATOR.SIZES",
                [[16], [32], [64], [128], [256]],
                "MODEL.RPN.IN_FEATURES",
                ["p2", "p3", "p4", "p5", "p6"],
                "MODEL.ROI_HEADS.NAME",
                "StandardROIHeads",
                "MODEL.ROI_HEADS.IN_FEATURES",
                ["p2", "p3", "p4", "p5"],
                "MODEL.ROI_BOX_HEAD.NAME",
                "FastRCNNConvFCHead",
                "MODEL.ROI_BOX_HEAD.NUM_CONV",
                4,
                "MODEL.ROI_BOX_HEAD.CONV_DIM",
                16,
                "MODEL.ROI_BOX_HEAD.NUM_FC",
                1,
                "MODEL.ROI_BOX_HEAD.FC_DIM",
                32,
                "MODEL.ROI_BOX_HEAD.NORM",
                norm,
                "MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION",
                7,
                "MODEL.ROI_MASK_HEAD.NAME",
                "MaskRCNNConvUpsampleHead",
                "MODEL.ROI_MASK_HEAD.NUM_CONV",
                4,
                "MODEL.ROI_MASK_HEAD.CONV_DIM",
                16,
                "MODEL.ROI_MASK_HEAD.NORM",
                norm,
                "MODEL.ROI_MASK_HEAD.POOLER_RESOLUTION",
                14,
            ]
        )
    else:
        cfg.merge_from_list(
            [
                "MODEL.MASK_ON",
                False,
                "MODEL.BACKBONE.NAME",
                "build_resnet_backbone",
                "MODEL.RESNETS.OUT_FEATURES",
                ["res4"],
                "MODEL.ANCHOR_GENERATOR.SIZES",
                [[16, 32, 64]],
                "MODEL.RPN.IN_FEATURES",
                ["res4"],
                "MODEL.ROI_HEADS.NAME",
                "Res5ROIHeads",
                "MODEL.ROI_HEADS.IN_FEATURES",
                ["res4"],
                "MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION",
                8,
            ]
        )
    cfg.merge_from_list(list(opts))
    return cfg


def norms_under(model, prefix: str) -> dict:
    """The norm modules (detectron2's ``Conv2d.norm``) whose names start with ``prefix``."""
    return {name: m for name, m in model.named_modules() if name.startswith(prefix) and name.endswith(".norm")}


def is_frozen_stage(name: str) -> bool:
    return name.startswith(FROZEN_PREFIXES)


def synthetic_batch(seed: int = 0) -> list:
    """Two images with two boxes each; each box's mask is the box."""
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for boxes in ([[4, 6, 40, 30], [30, 20, 60, 62]], [[10, 10, 50, 50], [2, 40, 24, 60]]):
        boxes = torch.tensor(boxes, dtype=torch.float32)
        masks = torch.zeros(len(boxes), IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bool)
        for mask, (x0, y0, x1, y1) in zip(masks, boxes.long().tolist()):
            mask[y0:y1, x0:x1] = True
        instances = Instances((IMAGE_SIZE, IMAGE_SIZE))
        instances.gt_boxes = Boxes(boxes)
        instances.gt_classes = torch.tensor([0, 2])
        instances.gt_masks = BitMasks(masks)
        image = torch.randint(0, 256, (3, IMAGE_SIZE, IMAGE_SIZE), generator=generator).float()
        batch.append({"image": image, "height": IMAGE_SIZE, "width": IMAGE_SIZE, "instances": instances})
    return batch


def train_step(cfg, model) -> torch.Tensor:
    """One SGD step of ``model`` (in training mode) with our optimizer; returns the total loss.

    Runs on one thread: for tensors this small that is fastest, and several threads spinning on a
    loaded CPU are many times slower.
    """
    model.train()
    optimizer = build_optimizer(cfg, model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with EventStorage():
            losses = model(synthetic_batch())
        total = sum(losses.values())
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return total.detach()


def snapshot(module) -> dict:
    """Copies of every parameter and buffer of ``module``, by state-dict key."""
    return {key: value.detach().clone() for key, value in module.state_dict().items()}
