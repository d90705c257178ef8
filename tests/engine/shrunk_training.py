"""The CPU demo (configs/demo_mask_rcnn_gn.yaml) shrunk so that a training step takes a fraction of a
second: ResNet-18 with a 16-wide FPN and heads, 64 px images, no evaluation unless a test asks for it.

``MIXED_NORMS`` puts SN (with the batch average) in the backbone, DN in the FPN and MGN in the heads, so
that a trained model holds every kind of norm state: running and batch-averaged statistics, DN's gates.
"""

import os
import subprocess
import sys

from detectron2.config import get_cfg

from sn_detection.d2 import add_sn_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_CONFIG = os.path.join(REPO, "configs", "demo_mask_rcnn_gn.yaml")
SHRINK = [
    "MODEL.RESNETS.DEPTH", "18", "MODEL.RESNETS.RES2_OUT_CHANNELS", "64", "MODEL.FPN.OUT_CHANNELS", "16",
    "MODEL.ROI_BOX_HEAD.CONV_DIM", "16", "MODEL.ROI_BOX_HEAD.FC_DIM", "32", "MODEL.ROI_MASK_HEAD.CONV_DIM", "16",
    "MODEL.SN.GN_GROUPS", "8", "MODEL.SN.DN_INIT_GROUPS", "8", "MODEL.RPN.POST_NMS_TOPK_TEST", "50",
    "INPUT.MIN_SIZE_TRAIN", "(64,)", "INPUT.MAX_SIZE_TRAIN", "107", "INPUT.MIN_SIZE_TEST", "64",
    "INPUT.MAX_SIZE_TEST", "107", "TEST.DETECTIONS_PER_IMAGE", "5", "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0",
    "SOLVER.WARMUP_ITERS", "2", "SOLVER.STEPS", "()", "DATALOADER.NUM_WORKERS", "0", "DATASETS.TEST", "()",
]  # fmt: skip
MIXED_NORMS = [
    "MODEL.RESNETS.NORM", "SN", "MODEL.FPN.NORM", "DN", "MODEL.ROI_BOX_HEAD.NORM", "MGN",
    "MODEL.ROI_MASK_HEAD.NORM", "MGN", "TEST.BATCH_AVERAGE.ENABLED", "True", "TEST.BATCH_AVERAGE.NUM_BATCHES", "2",
]  # fmt: skip


def shrunk_cfg(output_dir, *opts):
    """The shrunk demo config writing to ``output_dir``, then ``opts`` (KEY VALUE ...)."""
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.merge_from_file(DEMO_CONFIG)
    cfg.merge_from_list([*SHRINK, "OUTPUT_DIR", str(output_dir), *opts])
    return cfg


def train_shrunk(*opts, flags=(), env=None):
    """tools/train_net.py with ``flags`` on the shrunk demo config, then ``opts`` (KEY VALUE ...), in a
    subprocess with one intra-op thread per process and the variables of ``env``; returns its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "train_net.py"),
            *flags,
            "--config-file",
            DEMO_CONFIG,
            *SHRINK,
            *opts,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr
