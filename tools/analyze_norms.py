#!/usr/bin/env python
"""Which normalizer each part of a trained detector chose: SN importance weights, SSN's choice per layer (and
the iteration it was made), DN pooling, MN / MGN gates, per component (stem, res2-res5, FPN, RPN, box head,
mask head), as markdown, CSV and PNG.

    tools/analyze_norms.py --config-file CONFIG [--output-dir DIR] [--num-images N] [MODEL.WEIGHTS FILE ...]
    tools/analyze_norms.py --checkpoint output/.../model_final.pth [--output-dir DIR]

With a config, the weights are MODEL.WEIGHTS if given, else the last checkpoint in its OUTPUT_DIR.
"""

from sn_detection.engine.analyze_norms import main

if __name__ == "__main__":
    main()
