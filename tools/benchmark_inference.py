#!/usr/bin/env python
"""What the norms cost at inference: backbone + FPN and a whole Mask R-CNN, as built and folded, in PyTorch
and onnxruntime.

    tools/benchmark_inference.py [--norms GN,SN,SSN,DN,MN,MGN,BNSR,PONO,FrozenBN] [--rounds 5] [--threads 1]
                                 [--size 320,384] [--parts backbone,mask_rcnn,onnx] [--json out.json]

What is timed and how: sn_detection/benchmarks/inference.py.
"""

from sn_detection.benchmarks.inference import main

if __name__ == "__main__":
    main()
