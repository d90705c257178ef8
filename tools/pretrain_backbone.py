#!/usr/bin/env python
"""Pretrain the ResNet of a detection config on image classification (the embedded set by default, or an
ImageFolder such as ImageNet), and write a backbone checkpoint that the config loads with MODEL.WEIGHTS.

    tools/pretrain_backbone.py --config-file CFG [--num-gpus K] [--resume] [KEY VALUE ...]
    tools/pretrain_backbone.py --config-file CFG --cached      # the cached backbone: made once, path printed

See sn_detection/pretraining.
"""

from sn_detection.engine.pretrain_backbone import main

if __name__ == "__main__":
    main()
