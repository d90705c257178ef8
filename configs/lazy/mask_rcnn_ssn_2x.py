"""Mask R-CNN R50-FPN 2x with Sparse Switchable Norm in the backbone, FPN and both heads: the twin of
configs/mask_rcnn_ssn_2x.yaml, same modules and state-dict keys, the SSN authors' rules for the logits and
SparsestMax's radius rising from 0 to 1 over the schedule.

    tools/lazyconfig_train_net.py --config-file configs/lazy/mask_rcnn_ssn_2x.py --num-gpus 8
"""

from detectron2.config import LazyCall as L

from sn_detection.d2.optimizer import GateClippingSGD
from sn_detection.layers import NormFactory

from .common.mask_rcnn_fpn_2x import dataloader, lr_multiplier, model, optimizer, train

# the layers' options, as plain arguments (the yaml twin sets them under MODEL.SN)
ssn = L(NormFactory)(name="SSN", eps=1e-5, momentum=0.1, use_bn=True)
model.backbone.bottom_up.stem.norm = ssn
model.backbone.bottom_up.stages.norm = ssn
model.backbone.norm = ssn
model.roi_heads.box_head.conv_norm = ssn
model.roi_heads.mask_head.conv_norm = ssn

# the SSN authors' rules for the logits (the yaml twin's SOLVER.SSN_GATE_* defaults): a tenth of the
# learning rate, no weight decay, gradients clipped to a total norm of 1 by the optimizer's step
optimizer._target_ = GateClippingSGD
optimizer.params.ssn_gate_lr_factor = 0.1
optimizer.params.ssn_gate_clip_norm = 1.0
train.ssn_radius = (0.0, 1.0)  # SOLVER.SSN_RADIUS

# the SSN authors' ImageNet ResNet-50 (8,32), converted by
#   tools/convert_pretrained.py SRC pretrained/R-50-SSN.pkl --source ssn
# and the input convention it was trained with: RGB, ImageNet mean and std, stride in the 3x3 conv
train.init_checkpoint = "pretrained/R-50-SSN.pkl"
model.pixel_mean = [123.675, 116.28, 103.53]
model.pixel_std = [58.395, 57.12, 57.375]
model.input_format = "RGB"
model.backbone.bottom_up.stages.stride_in_1x1 = False
dataloader.train.mapper.image_format = "RGB"

train.batch_average.enabled = True
train.output_dir = "output/lazy/mask_rcnn_ssn_2x"
