#!/usr/bin/env python
"""Which of the package's files each layer's training step runs through, in order, and how often it hops
between them, on the kernel path under Triton's interpreter:

    TRITON_INTERPRET=1 $(tools/setup_kernel_env.sh) tools/code_path.py [--norms SN,PONO] [--calls]

See sn_detection/benchmarks/code_path.py.
"""

from sn_detection.benchmarks.code_path import main

if __name__ == "__main__":
    main()
