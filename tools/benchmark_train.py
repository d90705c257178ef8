#!/usr/bin/env python
"""End-to-end cost of the norms: one Mask R-CNN training step and one inference, per normalizer setting.

    tools/benchmark_train.py [--norms GN,SN,FrozenBN] [--rounds 8] [--threads N] [--json out.json]
                             [--graphed-backbone] [--config-file configs/demo_mask_rcnn_gn.yaml] [KEY VALUE ...]
    tools/benchmark_train.py --config-file configs/lazy/mask_rcnn_sn_lsj_100ep.py [...] [key=value ...]

What is timed and how: sn_detection/benchmarks/train.py.
"""

from sn_detection.benchmarks.train import main

if __name__ == "__main__":
    main()
