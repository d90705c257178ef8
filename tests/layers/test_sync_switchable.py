"""SyncSwitchableNorm2d: SN over a batch split across processes equals SN on the whole batch.

Two real processes (gloo on CPU) each get a slice of one batch, of unequal and even zero size; their
outputs, input gradients, summed parameter gradients and running statistics must equal those of a
single SwitchableNorm2d run on the concatenation. The same holds for a small network trained for a few
steps under DistributedDataParallel (the layer's collectives interleaved with DDP's gradient
all-reduce, as in detectron2's training), against the SN network trained on the concatenated batches.
"""

import pytest
import torch
import torch.distributed as dist
from gloo_processes import run_processes
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sn_detection.layers import SwitchableNorm2d, SyncSwitchableNorm2d

CHANNELS = 3
WORLD_SIZE = 2
SPLITS = {"3+1": (3, 1), "2+0": (2, 0), "0+2": (0, 2)}
AVERAGE_SPLITS = [(2, 1), (1, 3), (0, 2)]  # batch average over three steps of unequal slices
TRAINING_SPLITS = [(3, 1), (2, 0), (1, 2)]  # DDP steps; process 1 has no sample in the second


def problem(sizes, seed):
    """The full batch, the upstream gradient and a random layer state, identical in every process."""
    generator = torch.Generator().manual_seed(seed)
    shape = (sum(sizes), CHANNELS, 3, 4)
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 2 + 1
    grad_y = torch.randn(shape, generator=generator, dtype=torch.float64)
    state = SwitchableNorm2d(CHANNELS).double().state_dict()
    for key in ("weight", "bias", "mean_weight", "var_weight"):
        state[key] = torch.randn(state[key].shape, generator=generator, dtype=torch.float64)
    return x, grad_y, state


def local_slice(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def run_step(layer, x, grad_y):
    """One training step: output, input gradient and parameter gradients (zeros when unused)."""
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * grad_y).sum().backward()
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in layer.named_parameters()}
    return {"y": y.detach(), "x_grad": x.grad, "param_grads": grads}


def small_net(norm):
    """conv - norm - relu - conv - norm, the same initial weights for every ``norm`` class."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(2, CHANNELS, 3, padding=1), norm(CHANNELS), nn.ReLU(), nn.Conv2d(CHANNELS, CHANNELS, 1)]
    return nn.Sequential(*layers, norm(CHANNELS)).double()


def training_batch(sizes, step):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(sum(sizes), 2, 5, 6, generator=generator, dtype=torch.float64)
    return x, torch.randn(sum(sizes), CHANNELS, 5, 6, generator=generator, dtype=torch.float64)


def train_steps(net, optimizer, part_of, loss_scale):
    """SGD steps on TRAINING_SPLITS (the part of each batch this process sees: part_of(sizes)); the loss
    is a sum over samples, so the steps on the parts equal the steps on the whole batches. Returns the
    outputs of the first step."""
    outputs = []
    for step, sizes in enumerate(TRAINING_SPLITS):
        x, target = training_batch(sizes, step)
        part = part_of(sizes)
        y = net(x[part])
        loss = loss_scale * (y - target[part]).square().sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        outputs.append(y.detach())
    return outputs[0]


def train_with_ddp(rank):
    # gradients are averaged over the processes, hence the loss scale
    net = DistributedDataParallel(small_net(SyncSwitchableNorm2d), broadcast_buffers=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    first_output = train_steps(net, optimizer, lambda sizes: local_slice(sizes, rank), loss_scale=WORLD_SIZE)
    return {"first_output": first_output, "state": net.module.state_dict()}


def worker(rank, result_dir):
    results = {}
    for seed, (name, sizes) in enumerate(SPLITS.items()):
        x, grad_y, state = problem(sizes, seed)
        layer = SyncSwitchableNorm2d(CHANNELS).double()
        layer.load_state_dict(state)
        part = local_slice(sizes, rank)
        results[name] = run_step(layer, x[part], grad_y[part])
        results[name]["running"] = (layer.running_mean, layer.running_var)

    layer = SyncSwitchableNorm2d(CHANNELS).double()
    layer.start_batch_average()
    with torch.no_grad():
        for seed, sizes in enumerate(AVERAGE_SPLITS):
            layer(problem(sizes, seed)[0][local_slice(sizes, rank)])
    layer.finish_batch_average()
    results["batch average"] = (layer.running_mean, layer.running_var)
    results["ddp"] = train_with_ddp(rank)
    torch.save(results, result_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sync_sn")
    run_processes(worker, (directory,), WORLD_SIZE)
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("name", list(SPLITS))
def test_split_batch_equals_whole_batch(distributed_results, name):
    sizes = SPLITS[name]
    x, grad_y, state = problem(sizes, list(SPLITS).index(name))
    reference = SwitchableNorm2d(CHANNELS).double()
    reference.load_state_dict(state)
    expected = run_step(reference, x, grad_y)
    for rank, results in enumerate(distributed_results):
        part = local_slice(sizes, rank)
        got = results[name]
        assert got["y"].shape == (sizes[rank], CHANNELS, 3, 4)
        torch.testing.assert_close(got["y"], expected["y"][part], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["x_grad"], expected["x_grad"][part], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["running"][0], reference.running_mean, rtol=0, atol=1e-5)
        torch.testing.assert_close(got["running"][1], reference.running_var, rtol=0, atol=1e-5)
    for parameter, expected_grad in expected["param_grads"].items():
        summed = sum(results[name]["param_grads"][parameter] for results in distributed_results)
        torch.testing.assert_close(summed, expected_grad, rtol=0, atol=1e-5)


def test_batch_average_pools_all_processes(distributed_results):
    everything = torch.cat([problem(sizes, seed)[0] for seed, sizes in enumerate(AVERAGE_SPLITS)])
    mean, var = everything.mean((0, 2, 3)), everything.var((0, 2, 3), unbiased=False)
    for results in distributed_results:
        torch.testing.assert_close(results["batch average"][0], mean, rtol=0, atol=1e-5)
        torch.testing.assert_close(results["batch average"][1], var, rtol=0, atol=1e-5)


def test_training_with_ddp_equals_training_on_the_whole_batches(distributed_results):
    net = small_net(SwitchableNorm2d)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    first_output = train_steps(net, optimizer, lambda sizes: slice(None), loss_scale=1)
    for rank, results in enumerate(distributed_results):
        got = results["ddp"]
        part = local_slice(TRAINING_SPLITS[0], rank)
        torch.testing.assert_close(got["first_output"], first_output[part], rtol=0, atol=1e-5)
        assert got["state"].keys() == net.state_dict().keys()
        for key, value in net.state_dict().items():
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-5, msg=f"rank {rank}: {key}")


def test_without_process_group_equals_switchable_norm():
    assert not dist.is_initialized()
    x, grad_y, state = problem((4,), seed=5)
    layers = [SwitchableNorm2d(CHANNELS).double(), SyncSwitchableNorm2d(CHANNELS).double()]
    steps = []
    for layer in layers:
        layer.load_state_dict(state)
        steps.append(run_step(layer, x, grad_y))
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=0)
    torch.testing.assert_close(layers[1].state_dict(), layers[0].state_dict(), rtol=0, atol=0)
