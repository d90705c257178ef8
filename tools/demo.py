#!/usr/bin/env python
"""Draw a trained model's predictions with detectron2's Visualizer.

    tools/demo.py --config-file CONFIG [--input IMAGE_OR_GLOB ...] [--dataset sn_shapes_val] \
        [--num-images 8] [--output DIR] [--confidence-threshold 0.25] [--class-agnostic-nms IOU] \
        [MODEL.WEIGHTS FILE ...]

Without --input: the first images of --dataset, predictions | ground truth. The weights are
MODEL.WEIGHTS if given, else the last checkpoint in the config's OUTPUT_DIR; images go to
OUTPUT_DIR/demo unless --output says otherwise.
"""

from sn_detection.engine.demo import main

if __name__ == "__main__":
    main()
