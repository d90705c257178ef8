"""Small networks, batches and naive statistics for the tests of the batch average: the torch-only utility
(tests/layers/test_batch_average.py) and its detectron2 hook (tests/d2/test_hooks.py)."""

import copy

import torch
from torch import nn

from sn_detection.layers import (
    DynamicNorm2d,
    ModeNorm2d,
    SkewnessReducedBatchNorm2d,
    SwitchableNorm2d,
)

NORMS = {
    "SN": lambda c: SwitchableNorm2d(c),
    "BNSR": lambda c: SkewnessReducedBatchNorm2d(c),
    "MN": lambda c: ModeNorm2d(c, num_modes=2),
    "DN": lambda c: DynamicNorm2d(c, init_groups=4, init_batch_pool=True),
    "BN": lambda c: nn.BatchNorm2d(c),
}


class TwoNormNet(nn.Module):
    """conv - norm - relu - conv - norm: the second norm's input depends on the first's batch statistics."""

    def __init__(self, norm):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1 = NORMS[norm](8)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.norm2 = NORMS[norm](8)

    def norms(self):
        return [self.norm1, self.norm2]

    def forward(self, x):
        y = self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x)))))
        return {"loss": y.square().mean()}


def make_batches(seed=1):
    """Batches of different sizes and shapes: pooling must weight them by their number of values."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, 3, 9, 9), (3, 3, 7, 11), (1, 3, 12, 8)]
    return [torch.randn(shape, generator=generator) * 2 + 0.5 for shape in shapes]


def layer_inputs(model, batches):
    """The inputs each norm of (a copy of) the model receives when the batches run in training mode."""
    model = copy.deepcopy(model).train()
    inputs = {i: [] for i in range(len(model.norms()))}
    for i, norm in enumerate(model.norms()):
        norm.register_forward_pre_hook(lambda m, args, i=i: inputs[i].append(args[0].detach().double()))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    return [inputs[i] for i in range(len(inputs))]


def pixels(inputs):
    """All values of each channel over every sample and position of every batch: (C, total)."""
    return torch.cat([x.transpose(0, 1).flatten(1) for x in inputs], dim=1)


def expected_statistics(norm, inputs):
    """The naive statistics of the concatenated inputs, in the layer's buffer convention."""
    values = pixels(inputs)
    if isinstance(norm, ModeNorm2d):
        # every pixel of sample s counts for mode k with weight g_sk = softmax(gate(mean_HW(x_s)))_k
        weights, first, second = [], [], []
        for x in inputs:
            gates = torch.softmax(norm.gate.double()(x.mean((2, 3))), dim=1)  # (N, K)
            area = x.shape[2] * x.shape[3]
            weights.append(gates.sum(0) * area)
            first.append(torch.einsum("nk,nchw->kc", gates, x))
            second.append(torch.einsum("nk,nchw->kc", gates, x.square()))
        total = sum(weights)[:, None]
        mean = sum(first) / total
        return {"running_mean": mean, "running_var": sum(second) / total - mean.square()}
    unbiased = isinstance(norm, (nn.BatchNorm2d, SkewnessReducedBatchNorm2d))
    return {"running_mean": values.mean(1), "running_var": values.var(1, correction=1 if unbiased else 0)}


def assert_close(actual, expected, msg=None):
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6, msg=msg)


def assert_statistics(norm, expected):
    for name, value in expected.items():
        assert_close(getattr(norm, name), value, msg=name)


def parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class Untouchable:
    def __iter__(self):
        return self

    def __next__(self):
        raise AssertionError("a model without batch statistics must not read any batch")
