"""The low-precision contract of every layer (tests/layers): statistics and normalization in float32."""

import copy

import torch


def assert_float32_computation_rounded_once(layer, x, dtype):
    """``layer`` on ``x`` in ``dtype`` (fp16 as input, bf16 under CPU autocast) keeps that dtype and differs
    from the float32 layer's output on the same (already rounded) values only by its rounding to ``dtype``:
    half a unit in the last place, tested to one; statistics in fp16 or bf16 miss this by tens of units."""
    low = x.to(dtype)
    expected = copy.deepcopy(layer)(low.float())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y = layer(low)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), expected, rtol=torch.finfo(dtype).eps, atol=1e-6)
