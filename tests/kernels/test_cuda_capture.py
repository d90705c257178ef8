"""On a CUDA GPU: no layer makes the host wait for the device, and every layer's training step and inference
can be captured in a CUDA graph and replayed with the eager values (skipped without CUDA; the same property
is counted on the CPU by tests/kernels/test_launches.py).
"""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from sn_detection.layers import NORM_NAMES, build_norm


def layer_and_inputs(name, training, dtype=torch.float32, n=2):
    torch.manual_seed(0)
    layer = build_norm(name, 64).cuda().train(training)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    x = torch.randn(n, 64, 12, 20, device="cuda", dtype=dtype) * 2 + 0.5
    return layer, x, torch.randn_like(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", NORM_NAMES)
def test_no_layer_synchronises_with_the_host(name, training, dtype):
    for n in (1, 2):
        layer, x, grad_y = layer_and_inputs(name, training, dtype, n)  # copies to the GPU: before the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x.requires_grad_()).backward(grad_y)
            with torch.no_grad():
                layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", NORM_NAMES)
def test_a_captured_step_replays_the_eager_values(name, training):
    layer, x, grad_y = layer_and_inputs(name, training)
    eager = copy.deepcopy(layer)
    graphed = torch.cuda.make_graphed_callables(layer, (x.clone().requires_grad_(),))
    # its warm-up iterations moved the running statistics: the eager copy starts from the same state
    eager.load_state_dict(layer.state_dict())
    for _ in range(2):  # the second replay starts from the statistics the first one moved
        results = []
        for module, forward in ((eager, eager), (layer, graphed)):
            module.zero_grad(set_to_none=True)
            inp = x.clone().requires_grad_()
            y = forward(inp)
            y.backward(grad_y)
            grads = [inp.grad] + [p.grad for p in module.parameters()]
            results.append([y.detach()] + grads + [t.clone() for t in module.state_dict().values()])
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(want.float().abs().max().item(), 1.0))
