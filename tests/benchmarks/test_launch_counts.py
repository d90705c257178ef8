"""``launch_counts``: what it counts as a kernel launch, an allocation and a host synchronisation."""

import torch

from sn_detection.benchmarks.launch_counts import count_dispatch, count_training_step, recorded_kernels
from sn_detection.layers import build_norm, kernels


def test_views_and_allocations_are_no_launches():
    x = torch.randn(4, 6)
    counts = count_dispatch(lambda: (x.view(6, 4).t().expand(2, 4, 6), torch.empty(3), x + 1))
    assert counts.launches == 1 and counts.operations == {"add": 1}
    assert counts.allocations == 1 and counts.syncs == 0


def test_reading_a_value_or_a_data_dependent_shape_is_a_synchronisation():
    x = torch.randn(10)
    assert count_dispatch(lambda: float(x.sum())).syncs == 1
    assert count_dispatch(lambda: x[x > 0]).syncs == 1
    assert count_dispatch(lambda: x.nonzero()).syncs == 1
    assert count_dispatch(lambda: x.index_put((x > 0,), torch.tensor(0.0))).syncs == 1
    assert count_dispatch(lambda: torch.where(x > 0, x, 0.0)).syncs == 0


def test_triton_launches_are_counted_by_kernel_and_their_own_work_is_not(monkeypatch):
    # a stand-in kernel that does ATen work of its own, as Triton's interpreter does on the CPU
    class Kernel:
        __name__ = "_stand_in_kernel"

        def __getitem__(self, grid):
            return lambda *args, **meta: torch.ones(3).sum()

    with recorded_kernels() as names:  # an observer outside the count sees its launches too, and those after it
        counts = count_dispatch(lambda: (kernels.launch(Kernel(), (1,), (), {}), torch.ones(2) * 2))
        kernels.launch(Kernel(), (1,), (), {})
    assert counts.operations == {"triton:_stand_in_kernel": 1, "ones": 1, "mul": 1}
    assert names == ["_stand_in_kernel"] * 2


def test_a_training_step_sets_gradients_to_none_first_and_counts_forward_and_backward():
    layer = torch.nn.GroupNorm(4, 8)
    layer.weight.grad = torch.ones(8)
    x = torch.randn(2, 8, 3, 3)
    counts = count_training_step(layer, x, torch.randn_like(x))
    assert counts.operations == {"native_group_norm": 1, "native_group_norm_backward": 1}
    assert layer.weight.grad is not None and not torch.equal(layer.weight.grad, torch.ones(8))


def test_the_pytorch_path_is_counted_too():
    # float64 never takes the kernels: the layer runs its tensor-operation path, counted as such
    x = torch.randn(2, 16, 3, 3, dtype=torch.float64)
    counts = count_training_step(build_norm("SN", 16).double(), x, torch.randn_like(x))
    assert counts.launches > 12 and not any(op.startswith("triton:") for op in counts.operations)
