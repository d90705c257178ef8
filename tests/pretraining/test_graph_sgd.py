"""``DeviceLRSGD`` steps as the ``torch.optim.SGD`` it continues: pretraining's Nesterov SGD over groups of
other rates and weight decays, the rates moved by a schedule between steps, to float32 rounding (the fused
kernel rounds in another order than the foreach one); its momentum buffers are the source's, so the
source's state dict is that of eager steps; captured once in a CUDA graph and replayed, it reads the rate
of each replay. Changes that a captured step would not see are refused. On the CPU where torch has a fused
SGD there (torch >= 2.4), and on CUDA."""

import copy

import pytest
import torch
from torch import nn

from sn_detection.pretraining.graph_sgd import DeviceLRSGD, has_stepped

MOMENTUM, WEIGHT_DECAY = 0.9, 1e-4
STEPS = 6


def _has_fused_sgd(device: str) -> bool:
    if device == "cuda":
        return torch.cuda.is_available()
    parameter = nn.Parameter(torch.ones(1))
    parameter.grad = torch.ones(1)
    try:
        torch.optim.SGD([parameter], lr=torch.tensor(0.1), momentum=MOMENTUM, fused=True).step()
    except (NotImplementedError, RuntimeError):
        return False
    return True


DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not _has_fused_sgd("cpu"), reason="torch has no fused CPU SGD")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def network(device):
    torch.manual_seed(0)
    layers = (nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    return nn.Sequential(*layers).to(device)


def sgd(model):
    """Pretraining's groups: decayed weights, undecayed norms and biases, and a group at another rate (a
    gate's factor)."""
    conv, norm, _, _, linear = model
    return torch.optim.SGD(
        [
            {"params": [conv.weight, linear.weight]},
            {"params": [norm.weight, norm.bias, linear.bias], "weight_decay": 0.0},
            {"params": [conv.bias], "lr": 0.05, "weight_decay": 0.0},
        ],
        lr=0.1,
        momentum=MOMENTUM,
        nesterov=True,
        weight_decay=WEIGHT_DECAY,
    )


def gradients(model, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 6, 6, generator=generator).to(next(model.parameters()).device)
    model.zero_grad(set_to_none=False)
    model(x).square().mean().backward()


def schedule(optimizer, step):
    for group, base in zip(optimizer.param_groups, (0.1, 0.1, 0.05)):
        group["lr"] = base * (step + 1) / STEPS


def assert_same_state(got, expected):
    """The state dicts of two SGDs: the same groups, the same momentum buffers to float32 rounding."""
    got, expected = got.state_dict(), expected.state_dict()
    assert got["param_groups"] == expected["param_groups"] and got["state"].keys() == expected["state"].keys()
    for index, state in got["state"].items():
        torch.testing.assert_close(state["momentum_buffer"], expected["state"][index]["momentum_buffer"], msg=index)


def assert_same_parameters(got, expected):
    for name, parameter in got.named_parameters():
        torch.testing.assert_close(parameter, expected.get_parameter(name), msg=name)


def eager_step(model, optimizer, step):
    schedule(optimizer, step)
    gradients(model, step)
    optimizer.step()


@pytest.mark.parametrize("device", DEVICES)
def test_it_steps_as_the_sgd_it_continues(device):
    eager, graphed = network(device), network(device)
    eager_sgd, source = sgd(eager), sgd(graphed)
    eager_step(eager, eager_sgd, 0)
    eager_step(graphed, source, 0)  # its first step is the source's own
    device_sgd = DeviceLRSGD(source)
    for step in range(1, STEPS):
        eager_step(eager, eager_sgd, step)
        schedule(source, step)
        gradients(graphed, step)
        device_sgd.load_lrs()
        device_sgd.optimizer.step()
        assert_same_parameters(graphed, eager)
    assert_same_state(source, eager_sgd)
    # the source goes on eagerly from there, as a run resumed from its checkpoint would
    eager_step(eager, eager_sgd, STEPS)
    eager_step(graphed, source, STEPS)
    assert_same_parameters(graphed, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_once_it_replays_with_each_steps_rate():
    eager, graphed = network("cuda"), network("cuda")
    eager_sgd, source = sgd(eager), sgd(graphed)
    eager_step(eager, eager_sgd, 0)
    eager_step(graphed, source, 0)
    device_sgd = DeviceLRSGD(source)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # step 1 eagerly, on the stream that captures: the warm-up
        eager_step(eager, eager_sgd, 1)
        schedule(source, 1)
        gradients(graphed, 1)
        device_sgd.load_lrs()
        device_sgd.optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        device_sgd.optimizer.step()
    for step in range(2, STEPS):
        eager_step(eager, eager_sgd, step)
        schedule(source, step)
        gradients(graphed, step)  # into the gradients' own storage, which the graph reads
        device_sgd.load_lrs()
        graph.replay()
        assert_same_parameters(graphed, eager)
    assert_same_state(source, eager_sgd)


def test_it_needs_a_source_that_has_stepped():
    model = network("cpu")
    optimizer = sgd(model)
    assert not has_stepped(optimizer)
    with pytest.raises(ValueError, match="the optimizer has not stepped with its parameters' gradients"):
        DeviceLRSGD(optimizer)
    gradients(model, 0)
    assert not has_stepped(optimizer)  # gradients, no buffers yet (a step that mixed precision skipped)
    optimizer.step()
    assert has_stepped(optimizer)
    with pytest.raises(TypeError, match="DeviceLRSGD steps a torch.optim.SGD, not a Adam"):
        DeviceLRSGD(torch.optim.Adam(model.parameters()))


def test_a_change_the_captured_step_would_not_see_is_refused():
    model = network("cpu")
    optimizer = sgd(model)
    gradients(model, 0)
    optimizer.step()
    device_sgd = DeviceLRSGD(optimizer)
    device_sgd.check_unchanged()
    optimizer.param_groups[1]["weight_decay"] = 1e-3
    with pytest.raises(
        RuntimeError,
        match=r"the optimizer's momentum, dampening, weight_decay, nesterov, maximize "
        r"changed from .* after the step was captured",
    ):
        device_sgd.check_unchanged()
    optimizer.param_groups[1]["weight_decay"] = 0.0
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # new momentum buffers (a checkpoint's)
    with pytest.raises(RuntimeError, match="the optimizer's momentum buffers were replaced"):
        device_sgd.check_unchanged()
