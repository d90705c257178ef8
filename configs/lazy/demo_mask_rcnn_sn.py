"""The CPU demo as a LazyConfig: the twin of configs/demo_mask_rcnn_sn.yaml (Mask R-CNN R18-FPN with
Switchable Norm in the backbone, FPN and both heads, 128 px inputs, 64-wide FPN and heads, finetuned on
the embedded shapes dataset at 2 images per batch from a pretrained SN ResNet-18 with stem and res2
frozen, the batch average before evaluation and the norm analysis every 20 iterations).

    backbone=$(tools/pretrain_backbone.py --config-file configs/demo_mask_rcnn_sn.yaml --cached | tail -n 1)
    tools/lazyconfig_train_net.py --config-file configs/lazy/demo_mask_rcnn_sn.py train.init_checkpoint=$backbone
"""

import detectron2.data.transforms as T
import torch
from detectron2.config import LazyCall as L
from detectron2.layers import ShapeSpec
from detectron2.model_zoo import get_config
from detectron2.solver import WarmupParamScheduler
from fvcore.common.param_scheduler import MultiStepParamScheduler

from sn_detection.d2.optimizer import get_optimizer_params
from sn_detection.layers import NormFactory

WIDTH = 64  # FPN and heads

model = get_config("common/models/mask_rcnn_fpn.py").model
sn = L(NormFactory)(name="SN", eps=1e-5, momentum=0.1, use_bn=True)
model.backbone.bottom_up.stem.norm = sn
model.backbone.bottom_up.stages.norm = sn
model.backbone.norm = sn
model.roi_heads.box_head.conv_norm = sn
model.roi_heads.mask_head.conv_norm = sn

# the pretrained backbone's input convention: standardised BGR (ImageNet statistics)
model.pixel_mean = [103.53, 116.28, 123.675]
model.pixel_std = [57.375, 57.12, 58.395]
# ResNet-18 (basic blocks, which take no stride_in_1x1), stem and res2 frozen for finetuning
model.backbone.bottom_up.stages.depth = 18
del model.backbone.bottom_up.stages.stride_in_1x1
model.backbone.bottom_up.freeze_at = 2

model.backbone.out_channels = WIDTH
model.proposal_generator.head.in_channels = WIDTH
model.proposal_generator.anchor_generator.sizes = [[16], [32], [64], [128], [256]]
model.proposal_generator.batch_size_per_image = 128
model.proposal_generator.pre_nms_topk = (1000, 500)
model.proposal_generator.post_nms_topk = (256, 200)
model.roi_heads.num_classes = 5
model.roi_heads.batch_size_per_image = 64
model.roi_heads.positive_fraction = 0.5  # the YAML's reason
model.roi_heads.box_head.input_shape = ShapeSpec(channels=WIDTH, height=7, width=7)
model.roi_heads.box_head.conv_dims = [WIDTH] * 4
model.roi_heads.box_head.fc_dims = [256]
model.roi_heads.box_predictor.input_shape = ShapeSpec(channels=256)
model.roi_heads.mask_head.input_shape = ShapeSpec(channels=WIDTH, height=14, width=14)
model.roi_heads.mask_head.conv_dims = [WIDTH] * 5

dataloader = get_config("common/data/coco.py").dataloader
dataloader.train.dataset.names = "sn_shapes_train"
dataloader.train.mapper.augmentations = [
    L(T.ResizeShortestEdge)(short_edge_length=(128,), max_size=213, sample_style="choice"),
    L(T.RandomFlip)(horizontal=True),
]
dataloader.train.mapper.instance_mask_format = "bitmask"  # the embedded dataset's masks are RLE
dataloader.train.total_batch_size = 2
dataloader.train.num_workers = 1
dataloader.test.dataset.names = "sn_shapes_val"
dataloader.test.mapper.augmentations = [L(T.ResizeShortestEdge)(short_edge_length=128, max_size=213)]
dataloader.test.num_workers = 1

optimizer = L(torch.optim.SGD)(
    params=L(get_optimizer_params)(base_lr="${..lr}", weight_decay_norm=0.0, gate_lr_factor=1.0, gate_weight_decay=0.0),
    lr=0.02,
    momentum=0.9,
    weight_decay=1e-4,
)

train = get_config("common/train.py").train
train.max_iter = 1200
train.eval_period = 0  # evaluation after the last iteration
train.checkpointer.period = 100000
train.device = "cpu"
train.seed = 1
train.output_dir = "output/lazy/demo_mask_rcnn_sn"
train.batch_average = dict(enabled=True, num_batches=50)
train.norm_analysis_period = 20

lr_multiplier = L(WarmupParamScheduler)(
    scheduler=L(MultiStepParamScheduler)(values=[1.0, 0.1, 0.01], milestones=[900, 1100], num_updates=1200),
    warmup_length=100 / 1200,
    warmup_method="linear",
    warmup_factor=0.001,
)
