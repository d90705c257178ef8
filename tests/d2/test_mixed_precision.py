"""A training step of a tiny Mask R-CNN under autocast, with one of our norms in backbone, FPN and both
heads: bfloat16 on the CPU, float16 with a gradient scaler on CUDA (skipped without a CUDA device).

The step must give a finite loss, a finite gradient to every trainable parameter, and finite parameters
and buffers after the optimizer step; and our layers must really have received low-precision inputs
(tests/layers/test_edge_cases.py checks each layer alone under autocast).
"""

import pytest
import torch
from detectron2.modeling import build_model
from detectron2.utils.events import EventStorage
from tiny_rcnn import synthetic_batch, tiny_cfg

from sn_detection.d2 import build_optimizer
from sn_detection.layers import NORM_NAMES

PRECISIONS = {
    "cpu-bfloat16": ("cpu", torch.bfloat16),
    "cuda-float16": ("cuda", torch.float16),
}


def our_norms(model):
    return {name: m for name, m in model.named_modules() if type(m).__module__.startswith("sn_detection.layers")}


def record_input_dtypes(modules) -> tuple[set, list]:
    """The dtypes of the inputs the modules receive from now on, and the hook handles."""
    dtypes = set()
    handles = [m.register_forward_pre_hook(lambda module, args: dtypes.add(args[0].dtype)) for m in modules]
    return dtypes, handles


def autocast_training_step(model, optimizer, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Forward under autocast, backward and step outside it (scaled for float16), as in a mixed-precision
    training loop; returns the unscaled total loss. Gradients are left unscaled for inspection."""
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    with EventStorage(), torch.autocast(device, dtype=dtype):
        losses = model(synthetic_batch())
    total = sum(losses.values())
    optimizer.zero_grad()
    scaler.scale(total).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return total.detach()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", NORM_NAMES)
def test_autocast_training_step_is_finite(name, precision):
    device, dtype = PRECISIONS[precision]
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = tiny_cfg(name, "fpn", "MODEL.DEVICE", device)
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    norms = our_norms(model)
    assert norms, f"no {name} layer in the model"
    dtypes, handles = record_input_dtypes(norms.values())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and several spin on a loaded CPU
    try:
        total = autocast_training_step(model, build_optimizer(cfg, model), device, dtype)
    finally:
        torch.set_num_threads(threads)
        for handle in handles:
            handle.remove()

    assert dtype in dtypes, f"our layers saw only {dtypes}: autocast did not reach them"
    assert total.isfinite(), f"loss {total}"
    trainable = {key: p for key, p in model.named_parameters() if p.requires_grad}
    without_gradient = [key for key, p in trainable.items() if p.grad is None]
    assert not without_gradient, f"no gradient: {without_gradient}"
    non_finite = [key for key, p in trainable.items() if not p.grad.isfinite().all()]
    assert not non_finite, f"non-finite gradients: {non_finite}"
    state = model.state_dict()
    non_finite = [key for key, value in state.items() if value.is_floating_point() and not value.isfinite().all()]
    assert not non_finite, f"non-finite after the step: {non_finite}"
