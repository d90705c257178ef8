"""The config of the pretraining tests: the R18-FPN Mask R-CNN of configs/demo_compare_norms.yaml with
SN, pretrained a few iterations on a tiny classification set at 32 px."""

import os

from detectron2.config import get_cfg

from sn_detection.d2 import add_sn_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "demo_compare_norms.yaml")


def tiny_pretraining(data, output_dir, *opts):
    return [
        "MODEL.RESNETS.NORM", "SN", "MODEL.FPN.NORM", "SN", "MODEL.ROI_BOX_HEAD.NORM", "SN",
        "MODEL.ROI_MASK_HEAD.NORM", "SN", "PRETRAIN.DATA", str(data), "PRETRAIN.IMAGE_SIZE", "32",
        "PRETRAIN.IMS_PER_BATCH", "4", "PRETRAIN.MAX_ITER", "4", "PRETRAIN.WARMUP_ITERS", "2",
        "PRETRAIN.NUM_WORKERS", "0", "PRETRAIN.CHECKPOINT_PERIOD", "2", "PRETRAIN.OUTPUT_DIR", str(output_dir),
        "PRETRAIN.BATCH_AVERAGE_BATCHES", "2", "SEED", "1", *opts,
    ]  # fmt: skip


def tiny_cfg(data, output_dir, *opts):
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.merge_from_file(CONFIG)
    cfg.merge_from_list(tiny_pretraining(data, output_dir, *opts))
    return cfg
