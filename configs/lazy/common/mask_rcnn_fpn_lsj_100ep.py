"""detectron2's large-scale-jitter recipe, ``configs/new_baselines/mask_rcnn_R_50_FPN_100ep_LSJ.py``, as the
base of our LSJ configs: Mask R-CNN R50-FPN trained from scratch (random initialization, every stage
trained) for 100 epochs of COCO, 184,375 iterations at 64 images; each training image scaled by a random
factor in [0.1, 2] of 1024 px and cropped, or padded, to 1024 x 1024 (``ResizeScale``, ``FixedSizeCrop``,
a horizontal flip); mixed precision; a 2-conv RPN head and the 4conv1fc box head; SGD at LR 0.1 with
weight decay 4e-5, 500 warm-up iterations and steps at 163,889 and 177,546.

The recipe is loaded from detectron2, not copied, and changed only where our norms need it: our
optimizer's rules (no weight decay on the norms' affine parameters, the gates' own decay and learning
rate: ``get_optimizer_params``), and the ``train`` keys of tools/lazyconfig_train_net.py: the batch average
and the norm analysis (off here), and the graphed backbone (on: the crops give every training batch the
shape 1024 x 1024, so the backbone and FPN are captured once, after 3 eager steps, and replayed; the test
images vary in size and run eagerly). The files that import this set the norms where detectron2 puts
SyncBN (backbone, FPN) and NaiveSyncBatchNorm (box and mask heads).
"""

from detectron2.config import LazyCall as L
from detectron2.model_zoo import get_config

from sn_detection.d2.optimizer import get_optimizer_params

_recipe = get_config("new_baselines/mask_rcnn_R_50_FPN_100ep_LSJ.py")
model, dataloader, optimizer, train, lr_multiplier = (
    _recipe.model,
    _recipe.dataloader,
    _recipe.optimizer,
    _recipe.train,
    _recipe.lr_multiplier,
)

optimizer.params = L(get_optimizer_params)(
    base_lr="${..lr}", weight_decay_norm=0.0, gate_lr_factor=1.0, gate_weight_decay=0.0
)

train.batch_average = dict(enabled=False, num_batches=100)
train.norm_analysis_period = 0
train.graphed_backbone = dict(enabled=True, max_graphs=1, warmup=3)
