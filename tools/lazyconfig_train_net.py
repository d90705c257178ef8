#!/usr/bin/env python
"""Train and evaluate (COCO box and mask AP) a model from a LazyConfig, with the batch average and the
norm analysis of our yaml trainer (see sn_detection/engine/lazy.py).

    tools/lazyconfig_train_net.py --config-file configs/lazy/mask_rcnn_sn_2x.py [--num-gpus K] [--resume] \
        [--eval-only] [key=value ...]
"""

from sn_detection.engine.lazy import main

if __name__ == "__main__":
    main()
