#!/usr/bin/env python
"""What pretraining a backbone costs per norm: one training step of tools/pretrain_backbone.py, and the
hours an ImageNet epoch would take at that speed.

    tools/benchmark_pretrain.py [--config-file configs/mask_rcnn_sn_2x.yaml] [--norms BN,GN,SN]
        [--devices 8] [--classes 1000] [--epoch-images 1281167] [--data FOLDER] [--rounds 5] [--threads N]
        [--json PATH] [KEY VALUE ...]

What is timed and what is not: sn_detection/benchmarks/pretrain.py.
"""

from sn_detection.benchmarks.pretrain import main

if __name__ == "__main__":
    main()
