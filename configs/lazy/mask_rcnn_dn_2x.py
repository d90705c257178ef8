"""Mask R-CNN R50-FPN 2x with Dynamic Norm in the backbone, FPN and both heads: the twin of
configs/mask_rcnn_dn_2x.yaml.

    tools/lazyconfig_train_net.py --config-file configs/lazy/mask_rcnn_dn_2x.py --num-gpus 8
"""

from detectron2.config import LazyCall as L

from sn_detection.layers import NormFactory

from .common.mask_rcnn_fpn_2x import dataloader, lr_multiplier, model, optimizer, train

# DN starts as GN with 32 groups and no batch pooling: exactly the GN network it loads
dn = L(NormFactory)(name="DN", eps=1e-5, momentum=0.1, init_groups=32, init_batch_pool=False)
model.backbone.bottom_up.stem.norm = dn
model.backbone.bottom_up.stages.norm = dn
model.backbone.norm = dn
model.roi_heads.box_head.conv_norm = dn
model.roi_heads.mask_head.conv_norm = dn

# Detectron's ImageNet R-50-GN, converted by
#   tools/convert_pretrained.py SRC pretrained/R-50-GN.pkl --source gn
# and its input convention: BGR, mean subtracted, no scaling, stride in the 3x3 conv
train.init_checkpoint = "pretrained/R-50-GN.pkl"
model.pixel_mean = [103.53, 116.28, 123.675]
model.pixel_std = [1.0, 1.0, 1.0]
model.backbone.bottom_up.stages.stride_in_1x1 = False

train.batch_average.enabled = True
train.output_dir = "output/lazy/mask_rcnn_dn_2x"
