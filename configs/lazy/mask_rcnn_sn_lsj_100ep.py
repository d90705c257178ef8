"""Mask R-CNN R50-FPN with synchronized Switchable Norm in the backbone, FPN and both heads, trained from
scratch with detectron2's large-scale-jitter recipe for 100 epochs (1024 x 1024 crops; the backbone and
FPN replayed as CUDA graphs): the twin of mask_rcnn_gn_lsj_100ep.py, which differs in its norm alone.

    tools/lazyconfig_train_net.py --config-file configs/lazy/mask_rcnn_sn_lsj_100ep.py --num-gpus 8

Choices, where the recipe has SyncBN:

- SyncSN rather than SN. The recipe normalizes with batch statistics over all GPUs (SyncBN in the
  backbone and FPN, NaiveSyncBatchNorm in the heads). SyncSN is SN whose BN branch pools its statistics
  over all processes (the SN paper's synchronized SN), so that branch sees the batch the recipe's BN sees;
  its all-reduce weighs unequal and empty per-GPU RoI batches exactly, which is what the recipe takes
  NaiveSyncBatchNorm(stats_mode="N") for in the heads. In one process it is SN.
- From scratch, as the recipe: detectron2 trains these models from random initialization, 100 epochs
  being long enough, and SN and GN then differ in their norms alone rather than also in two ImageNet
  models (the SN authors' and Detectron's GN backbone). To start from the SN authors' ImageNet ResNet-50
  instead, give ``train.init_checkpoint=pretrained/R-50-SN.pkl`` with its input convention and frozen
  stem and res2, as mask_rcnn_sn_2x.py does.
- The SN paper's batch average of the BN branch's test statistics before each evaluation (global, SyncSN
  pooling it over the processes).
"""

from detectron2.config import LazyCall as L

from sn_detection.layers import NormFactory

from .common.mask_rcnn_fpn_lsj_100ep import dataloader, lr_multiplier, model, optimizer, train

sn = L(NormFactory)(name="SyncSN", eps=1e-5, momentum=0.1, use_bn=True)
model.backbone.bottom_up.stem.norm = sn
model.backbone.bottom_up.stages.norm = sn
model.backbone.norm = sn
model.roi_heads.box_head.conv_norm = sn
model.roi_heads.mask_head.conv_norm = sn

train.batch_average.enabled = True
train.output_dir = "output/lazy/mask_rcnn_sn_lsj_100ep"
