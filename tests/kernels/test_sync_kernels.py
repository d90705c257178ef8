"""SyncSN and SyncSSN across processes on their fused kernels (``switchable_kernels``, pooled): a batch split over
two real processes (gloo on the CPU, the kernels under Triton's interpreter in each) gives the outputs, input
gradients, summed parameter gradients and running statistics of one SN (SSN) on the whole batch; a process whose
slice is empty runs the autograd path and takes part in the same all-reduces.

Runs where tests/kernels/test_map_passes.py runs, with the interpreter (the processes are CPU ones).
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") != "1":
    pytest.skip("two CPU processes run the kernels under Triton's interpreter", allow_module_level=True)

from gloo_processes import run_processes

from sn_detection.benchmarks.launch_counts import recorded_kernels
from sn_detection.layers import (
    SparseSwitchableNorm2d,
    SwitchableNorm2d,
    SyncSparseSwitchableNorm2d,
    SyncSwitchableNorm2d,
)

CHANNELS = 6
WORLD_SIZE = 2
SPLITS = {"3+1": (3, 1), "2+0": (2, 0), "0+2": (0, 2)}
# a layer of one process on the whole batch, and its synchronised twin
LAYERS = {"SN": (SwitchableNorm2d, SyncSwitchableNorm2d), "SSN": (SparseSwitchableNorm2d, SyncSparseSwitchableNorm2d)}


def problem(sizes, seed, name="SN"):
    """The whole batch, the upstream gradient and a random layer state, identical in every process (SSN's at
    a radius where SparsestMax's circle and edge act)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (sum(sizes), CHANNELS, 3, 4)
    x = torch.randn(shape, generator=generator) * 2 + 1
    grad_y = torch.randn(shape, generator=generator)
    state = LAYERS[name][0](CHANNELS).state_dict()
    if name == "SSN":
        state["radius"] = torch.tensor(0.4)
    for key in ("weight", "bias", "mean_weight", "var_weight"):
        state[key] = torch.randn(state[key].shape, generator=generator)
    state["running_mean"] = torch.randn(CHANNELS, generator=generator)
    return x, grad_y, state


def step(layer, x, grad_y):
    x = x.clone().requires_grad_()
    with recorded_kernels() as kernels:
        y = layer(x)
        y.backward(grad_y)
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in layer.named_parameters()}
    buffers = {name: b.clone() for name, b in layer.named_buffers()}
    return {"y": y.detach(), "x": x.grad, "grads": grads, "buffers": buffers, "kernels": kernels}


def worker(rank, result_dir):
    results = {}
    for layer_name, (_, synced) in LAYERS.items():
        for seed, (name, sizes) in enumerate(SPLITS.items()):
            x, grad_y, state = problem(sizes, seed, layer_name)
            layer = synced(CHANNELS)
            layer.load_state_dict(state)
            start = sum(sizes[:rank])
            part = slice(start, start + sizes[rank])
            results[layer_name, name] = step(layer, x[part], grad_y[part])
    torch.save(results, result_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sync_kernels")
    run_processes(worker, (directory,), WORLD_SIZE, timeout=300)
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_a_split_batch_on_the_kernels_equals_the_whole_batch(distributed_results, layer_name, name):
    sizes = SPLITS[name]
    x, grad_y, state = problem(sizes, list(SPLITS).index(name), layer_name)
    whole = LAYERS[layer_name][0](CHANNELS)
    whole.load_state_dict(state)
    expected = step(whole, x, grad_y)
    ranks = [results[layer_name, name] for results in distributed_results]
    for rank, size in enumerate(sizes):
        kernels = ranks[rank]["kernels"]
        # a non-empty slice takes the pooled kernels: its sums, then its gradient of them, all-reduced
        assert not size or {"_pooled_sums_kernel", "_forward_kernel", "_backward_kernel"} <= set(kernels), kernels
        assert not size or kernels.count("_backward_kernel") == 2, kernels
    tolerance = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), expected["y"], **tolerance)
    torch.testing.assert_close(torch.cat([r["x"] for r in ranks]), expected["x"], **tolerance)
    for key, grad in expected["grads"].items():
        total = sum(r["grads"][key] for r in ranks)
        torch.testing.assert_close(total, grad, rtol=2e-5, atol=2e-5 * max(grad.abs().max().item(), 1.0), msg=key)
    for rank in ranks:  # every process stores the statistics of the whole batch
        for key, buffer in expected["buffers"].items():
            torch.testing.assert_close(rank["buffers"][key], buffer, **tolerance, msg=key)
