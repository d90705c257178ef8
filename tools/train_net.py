#!/usr/bin/env python
"""Train and evaluate (COCO box and mask AP) a detectron2 model whose norms may be sn_detection's.

    tools/train_net.py --config-file configs/demo_mask_rcnn_gn.yaml [--eval-only] [--resume] \
        [--num-gpus K] [KEY VALUE ...]

`--config` works as well as `--config-file`: argparse accepts any unambiguous prefix of an option.
"""

from sn_detection.engine.train_net import main

if __name__ == "__main__":
    main()
