#!/usr/bin/env python
"""Pretrain every norm's backbone under a grid of PRETRAIN settings (learning rate, warm-up) at one budget,
into the backbone cache that tools/compare_norms.py --finetune reads; re-running the same command resumes.

    tools/pretrain_grid.py [--norms BN,GN,SN,DN,MGN] [--lrs 0.05,0.1,0.2,0.4] [--warmups 0,40] [--jobs N]
        [--target-top1 X] [--publish FILE] [--plan-only] [KEY VALUE ...]
    tools/compare_norms.py --finetune --backbones output/pretrain_grid/best.json    # each norm's best
    tools/compare_norms.py --finetune --backbones model_zoo/sections/1_pretrain_grid.best.json  # as published

See sn_detection/experiments/pretrain_grid.
"""

import sys

from sn_detection.experiments.pretrain_grid.cli import main

if __name__ == "__main__":
    sys.exit(main())
