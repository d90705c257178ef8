"""Mask R-CNN R50-FPN with Group Norm (32 groups) in the backbone, FPN and both heads, trained from
scratch with detectron2's large-scale-jitter recipe for 100 epochs (1024 x 1024 crops; the backbone and
FPN replayed as CUDA graphs): the baseline of mask_rcnn_sn_lsj_100ep.py, which differs in its norm alone.

    tools/lazyconfig_train_net.py --config-file configs/lazy/mask_rcnn_gn_lsj_100ep.py --num-gpus 8

detectron2 has no GN model with this recipe (its LSJ baselines use SyncBN); GN everywhere, from scratch,
is the GN paper's detector trained from scratch, here with the recipe's data, schedule and optimizer.
"""

from detectron2.config import LazyCall as L

from sn_detection.layers import NormFactory

from .common.mask_rcnn_fpn_lsj_100ep import dataloader, lr_multiplier, model, optimizer, train

gn = L(NormFactory)(name="GN", num_groups=32, eps=1e-5)
model.backbone.bottom_up.stem.norm = gn
model.backbone.bottom_up.stages.norm = gn
model.backbone.norm = gn
model.roi_heads.box_head.conv_norm = gn
model.roi_heads.mask_head.conv_norm = gn

train.output_dir = "output/lazy/mask_rcnn_gn_lsj_100ep"
