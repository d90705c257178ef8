#!/usr/bin/env python
"""Kernel launches, allocations and host synchronisations of every layer's training step (forward + backward,
gradients set to None first) and inference forward, next to torch's GroupNorm and BatchNorm.

    tools/count_launches.py [--device cuda] [--json counts.json] [--host-time [--baseline REF]]
    TRITON_INTERPRET=1 $(tools/setup_kernel_env.sh) tools/count_launches.py   # the GPU's path, on the CPU

See sn_detection/benchmarks/launch_counts.py.
"""

from sn_detection.benchmarks.launch_counts import main

if __name__ == "__main__":
    main()
