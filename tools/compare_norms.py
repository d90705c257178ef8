#!/usr/bin/env python
"""Train the same CPU-sized Mask R-CNN from scratch once per norm setting and seed, evaluate COCO box and
mask AP, and write a table (mean ± std over seeds), a CSV and plots. Resumable: finished runs are skipped.

    tools/compare_norms.py [--settings BN GN SN DN MGN SN/GN GN/SN] [--seeds 1 2 3] [--iters N] \
        [--output-dir output/compare_norms] [--publish model_zoo/sections/NAME.md] [--report-only] [KEY VALUE ...]

See sn_detection/experiments/compare_norms for the choices made.
"""

import sys

from sn_detection.experiments.compare_norms.cli import main

if __name__ == "__main__":
    sys.exit(main())
