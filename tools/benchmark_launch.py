#!/usr/bin/env python
"""Each learned layer's training step on CUDA with Triton's ordinary launch path and with the direct launch of
the compiled kernels, side by side.

    tools/benchmark_launch.py [--norms SN,DN] [--shape 2,256,6,6] [--rounds 15] [--json launch.json]

See sn_detection/benchmarks/launch_paths.py.
"""

from sn_detection.benchmarks.launch_paths import main

if __name__ == "__main__":
    main()
