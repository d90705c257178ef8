"""Mask R-CNN R50-FPN 2x with Switchable Norm in the backbone, FPN and both heads (the SN paper's Table 5
row SN / SN): the twin of configs/mask_rcnn_sn_2x.yaml, same modules and state-dict keys.

    tools/lazyconfig_train_net.py --config-file configs/lazy/mask_rcnn_sn_2x.py --num-gpus 8
"""

from detectron2.config import LazyCall as L

from sn_detection.layers import NormFactory

from .common.mask_rcnn_fpn_2x import dataloader, lr_multiplier, model, optimizer, train

# the layers' options, as plain arguments (the yaml twin sets them under MODEL.SN)
sn = L(NormFactory)(name="SN", eps=1e-5, momentum=0.1, use_bn=True)
model.backbone.bottom_up.stem.norm = sn
model.backbone.bottom_up.stages.norm = sn
model.backbone.norm = sn
model.roi_heads.box_head.conv_norm = sn
model.roi_heads.mask_head.conv_norm = sn

# the SN authors' ImageNet ResNet-50, converted by
#   tools/convert_pretrained.py SRC pretrained/R-50-SN.pkl --source sn
# and the input convention it was trained with: RGB, ImageNet mean and std, stride in the 3x3 conv
train.init_checkpoint = "pretrained/R-50-SN.pkl"
model.pixel_mean = [123.675, 116.28, 103.53]
model.pixel_std = [58.395, 57.12, 57.375]
model.input_format = "RGB"
model.backbone.bottom_up.stages.stride_in_1x1 = False
dataloader.train.mapper.image_format = "RGB"

train.batch_average.enabled = True
train.output_dir = "output/lazy/mask_rcnn_sn_2x"
