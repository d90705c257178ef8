#!/usr/bin/env python
"""Forward + backward time and memory of every norm of ``build_norm``, next to torch's GroupNorm and BatchNorm.

    tools/benchmark_norms.py [--shapes small] [--repeats 5] [--threads N] [--device cuda] [--amp] [--json results.json]

Shapes, memory and ratios: sn_detection/benchmarks/norms.py.
"""

from sn_detection.benchmarks.norms import main

if __name__ == "__main__":
    main()
