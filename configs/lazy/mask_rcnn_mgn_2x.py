"""Mask R-CNN R50-FPN 2x with Mode Group Norm in the backbone, FPN and both heads: the twin of
configs/mask_rcnn_mgn_2x.yaml.

    tools/lazyconfig_train_net.py --config-file configs/lazy/mask_rcnn_mgn_2x.py --num-gpus 8
"""

from detectron2.config import LazyCall as L

from sn_detection.layers import NormFactory

from .common.mask_rcnn_fpn_2x import dataloader, lr_multiplier, model, optimizer, train

# K = 2 modes, as the MGN paper's comparison with GN
mgn = L(NormFactory)(name="MGN", eps=1e-5, num_modes=2)
model.backbone.bottom_up.stem.norm = mgn
model.backbone.bottom_up.stages.norm = mgn
model.backbone.norm = mgn
model.roi_heads.box_head.conv_norm = mgn
model.roi_heads.mask_head.conv_norm = mgn

# Detectron's ImageNet R-50-GN, converted by
#   tools/convert_pretrained.py SRC pretrained/R-50-GN.pkl --source gn
train.init_checkpoint = "pretrained/R-50-GN.pkl"
model.pixel_mean = [103.53, 116.28, 123.675]
model.pixel_std = [1.0, 1.0, 1.0]
model.backbone.bottom_up.stages.stride_in_1x1 = False

train.output_dir = "output/lazy/mask_rcnn_mgn_2x"
