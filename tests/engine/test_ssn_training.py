"""tools/train_net.py with SSN everywhere: the trainer raises the radius of every SSN layer before each
iteration and records the fixed choices, which the final checkpoint holds."""

import os

import torch
from shrunk_training import train_shrunk

SSN_EVERYWHERE = [
    "MODEL.RESNETS.NORM", "SSN", "MODEL.FPN.NORM", "SSN", "MODEL.ROI_BOX_HEAD.NORM", "SSN",
    "MODEL.ROI_MASK_HEAD.NORM", "SSN", "TEST.BATCH_AVERAGE.ENABLED", "True", "TEST.BATCH_AVERAGE.NUM_BATCHES", "1",
]  # fmt: skip


def test_the_trainer_drives_the_radius_into_the_checkpoint(tmp_path):
    # a radius from 0.9: every weight vector is one-hot from the first iteration, and fixed there
    train_shrunk(
        *SSN_EVERYWHERE, "OUTPUT_DIR", str(tmp_path), "SOLVER.MAX_ITER", "4", "SOLVER.SSN_RADIUS", "(0.9, 1.0)"
    )
    state = torch.load(os.path.join(tmp_path, "model_final.pth"), map_location="cpu", weights_only=False)["model"]
    radii = {round(float(value), 6) for key, value in state.items() if key.endswith(".radius")}
    assert radii == {0.975}  # before the last of 4 iterations: 0.9 + 0.1 * 3 / 4
    layers = [key[: -len("mean_fixed")] for key in state if key.endswith(".mean_fixed")]
    assert len(layers) > 20 and any(key.startswith("backbone.bottom_up.") for key in layers)
    for prefix in layers:
        assert int(state[prefix + "mean_fixed"]) >= 0 and int(state[prefix + "var_fixed"]) >= 0, prefix
        assert int(state[prefix + "mean_fixed_at"]) == 0, prefix  # the schedule's iteration, recorded
        assert int(state[prefix + "iteration"]) == 3
