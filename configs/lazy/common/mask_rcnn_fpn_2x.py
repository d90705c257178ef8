"""Setting 3 of the SN paper (Table 5) as a LazyConfig: Mask R-CNN R50-FPN, 2x at 2 images per GPU on 8
GPUs (16 per batch), COCO 2017, the twin of configs/_base/mask_rcnn_fpn_2x.yaml.

detectron2's common Mask R-CNN with the paper's heads (the GN paper's 4conv1fc box head, a 4-conv mask
head), stem and res2 frozen for finetuning, Detectron's warm-up (500 iterations from 1/3) and the 2x steps
(120k and 160k of 180k). The files that import this set the norms, as plain arguments of
``sn_detection.layers.NormFactory``, and the pretrained backbone with its input convention.
"""

import torch
from detectron2.config import LazyCall as L
from detectron2.model_zoo import get_config
from detectron2.solver import WarmupParamScheduler
from fvcore.common.param_scheduler import MultiStepParamScheduler

from sn_detection.d2.optimizer import get_optimizer_params

model = get_config("common/models/mask_rcnn_fpn.py").model
model.backbone.bottom_up.freeze_at = 2
model.roi_heads.box_head.conv_dims = [256, 256, 256, 256]
model.roi_heads.box_head.fc_dims = [1024]

dataloader = get_config("common/data/coco.py").dataloader
dataloader.train.total_batch_size = 16

# our norms' rules: no weight decay on their affine parameters, the gates' own decay and learning rate
optimizer = L(torch.optim.SGD)(
    params=L(get_optimizer_params)(base_lr="${..lr}", weight_decay_norm=0.0, gate_lr_factor=1.0, gate_weight_decay=0.0),
    lr=0.02,
    momentum=0.9,
    weight_decay=1e-4,
)

train = get_config("common/train.py").train
train.max_iter = 180000
train.eval_period = 0
train.checkpointer.period = 10000
# the SN paper's batch average of the batch-dependent test statistics before each evaluation (per
# process), and the logging of what the learned norms chose (0: off); tools/lazyconfig_train_net.py
train.batch_average = dict(enabled=False, num_batches=100)
train.norm_analysis_period = 0

lr_multiplier = L(WarmupParamScheduler)(
    scheduler=L(MultiStepParamScheduler)(values=[1.0, 0.1, 0.01], milestones=[120000, 160000], num_updates=180000),
    warmup_length=500 / 180000,
    warmup_method="linear",
    warmup_factor=1 / 3,
)
