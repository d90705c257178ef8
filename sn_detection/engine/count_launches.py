"""Kernel launches, allocations and host synchronisations of every layer's training step (forward + backward,
gradients set to None first) and inference forward, next to torch's GroupNorm and BatchNorm
(``sn_detection.layers.launches``). On a GPU each launch costs microseconds of host time, so this is what
makes a layer host-bound there; counted on any machine:

    python tools/count_launches.py [--device cuda] [--json counts.json]
    TRITON_INTERPRET=1 $(tools/setup_kernel_env.sh) tools/count_launches.py   # the GPU's path, on the CPU

Without a GPU and without the interpreter, the layers run their PyTorch path, and that is what is counted.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

import torch

from ..layers.launches import layer_counts


def main(argv: Optional[Sequence[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: CUDA where available, else the CPU")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = layer_counts(device)
    path = "the Triton kernel path" if rows[0]["kernel_path"] else "the PyTorch path (no Triton kernels here)"
    print(f"torch {torch.__version__}, {device.type}, {'x'.join(map(str, rows[0]['shape']))}: {path}")
    profiled = device.type == "cuda"
    header = f"{'layer':13} {'train launches':>14} {'allocations':>11} {'syncs':>5} {'inference launches':>18} {'syncs':>5}"
    header += f" {'profiler kernels':>16}" if profiled else ""
    print(header + "\n" + "-" * len(header))
    for row in rows:
        line = (f"{row['layer']:13} {row['train_launches']:14} {row['train_allocations']:11} {row['train_syncs']:5} "
                f"{row['inference_launches']:18} {row['inference_syncs']:5}")
        print(line + (f" {row['train_kernels_profiled']:16}" if profiled else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
