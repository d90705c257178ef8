#!/usr/bin/env python
"""Export a trained model to ONNX or TorchScript, as detectron2's tools/deploy/export_model.py, and check
the exported file against PyTorch on a sample image.

    tools/export_model.py --config-file CONFIG --output DIR [--format onnx|torchscript] \
        [--export-method tracing|scripting] [--sample-image IMAGE] [--fold] [MODEL.WEIGHTS FILE ...]

LazyConfigs (.py) take key=value overrides (train.init_checkpoint=FILE). See docs/deployment.md.
"""

from sn_detection.engine.export import main

if __name__ == "__main__":
    main()
