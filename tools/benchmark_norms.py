"""Forward + backward time and memory of every norm of ``build_norm``, next to torch's GroupNorm and BatchNorm.

Not a test: a measurement to run by hand, on CPU and, when available, CUDA:

    python tools/benchmark_norms.py [--shapes small] [--repeats 5] [--threads N] [--json results.json]

Shapes are those of detection: an FPN level at batch 2 (2, 256, 200, 336), the RoI box head
(512, 256, 14, 14) and a stem-sized map (2, 64, 400, 672). Each layer runs in training mode in float32;
the time is the median of ``--repeats`` forward + backward passes after two warm-up passes.

Memory is what one forward + backward costs beyond its input and upstream gradient:

- CUDA: ``torch.cuda.max_memory_allocated()`` during the pass minus the memory allocated before it
  (output, tensors saved for backward, temporaries and the input gradient).
- CPU: PyTorch keeps no allocator statistics, so the number is what the layer keeps alive between
  forward and backward, the part that scales with network depth: the bytes of the distinct storages
  saved for backward (seen through ``torch.autograd.graph.saved_tensors_hooks``, each storage counted
  once) plus the output. Short-lived temporaries are not seen. The input is counted, since every layer
  saves it, so a ratio of 1.0 means "nothing beyond what GroupNorm keeps".

Ratios are relative to ``torch.nn.GroupNorm(32, C)`` on the same shape and device. On a shared machine
``--threads 1`` gives steadier CPU ratios: with several threads every small (N, C)-sized op opens a
parallel region, which costs milliseconds when another process holds a core.
"""

import argparse
import json
import statistics
import time

import torch
from torch import nn

from sn_detection.layers import NORM_NAMES, build_norm

SHAPES = {
    "full": [(2, 256, 200, 336), (512, 256, 14, 14), (2, 64, 400, 672)],
    "small": [(2, 64, 50, 84), (64, 64, 14, 14), (2, 32, 100, 168)],
}
REFERENCE = "torch GN(32)"


def candidates(num_channels):
    """(label, layer) pairs: torch's references first, then every registered norm with its defaults."""
    yield REFERENCE, nn.GroupNorm(32, num_channels)
    yield "torch BN", nn.BatchNorm2d(num_channels)
    for name in NORM_NAMES:
        yield name, build_norm(name, num_channels)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(layer, x, grad_y):
    layer(x).backward(grad_y)
    x.grad = None
    layer.zero_grad(set_to_none=True)


def median_seconds(layer, x, grad_y, repeats):
    for _ in range(2):
        step(layer, x, grad_y)
    times = []
    for _ in range(repeats):
        synchronize(x.device)
        start = time.perf_counter()
        step(layer, x, grad_y)
        synchronize(x.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kept_bytes(layer, x):
    """Bytes of the distinct storages saved for backward, plus the output (see the module docstring)."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(x)
    storages[y.untyped_storage().data_ptr()] = y.untyped_storage().nbytes()
    return sum(storages.values())


def peak_cuda_bytes(layer, x, grad_y):
    torch.cuda.synchronize(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    before = torch.cuda.memory_allocated(x.device)
    step(layer, x, grad_y)
    torch.cuda.synchronize(x.device)
    return torch.cuda.max_memory_allocated(x.device) - before


def measure(device, shape, repeats):
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=generator).requires_grad_()
    grad_y = torch.randn(shape, device=device, generator=generator)
    rows = []
    for label, layer in candidates(shape[1]):
        layer = layer.to(device).train()
        seconds = median_seconds(layer, x, grad_y, repeats)
        memory = peak_cuda_bytes(layer, x, grad_y) if device.type == "cuda" else kept_bytes(layer, x)
        rows.append({"device": device.type, "shape": list(shape), "layer": label, "seconds": seconds, "bytes": memory})
    reference = rows[0]
    for row in rows:
        row["time_vs_gn"] = row["seconds"] / reference["seconds"]
        row["memory_vs_gn"] = row["bytes"] / reference["bytes"]
    return rows


def print_table(rows):
    header = f"{'device':6} {'shape':20} {'layer':13} {'fwd+bwd ms':>10} {'x GN':>6} {'memory MiB':>10} {'x GN':>6}"
    print(header)
    print("-" * len(header))
    for row in rows:
        shape = "x".join(map(str, row["shape"]))
        print(
            f"{row['device']:6} {shape:20} {row['layer']:13} {1e3 * row['seconds']:10.1f} "
            f"{row['time_vs_gn']:6.2f} {row['bytes'] / 2**20:10.1f} {row['memory_vs_gn']:6.2f}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="full")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="CPU threads (default: PyTorch's choice)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    rows = []
    for device in devices:
        for shape in SHAPES[args.shapes]:
            rows += measure(device, shape, args.repeats)
            print_table(rows[-len(NORM_NAMES) - 2 :])
            print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
