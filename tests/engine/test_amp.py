"""tools/train_net.py's trainer refuses mixed precision for a model off CUDA, naming the key, before it
trains (detectron2's AMPTrainer would fail at the first step, or train in float32 where CUDA exists)."""

import pytest
from shrunk_training import shrunk_cfg

from sn_detection.engine import Trainer


def test_mixed_precision_off_cuda_is_refused_naming_the_key(tmp_path):
    cfg = shrunk_cfg(tmp_path, "SOLVER.AMP.ENABLED", "True", "MODEL.DEVICE", "cpu")
    with pytest.raises(ValueError, match="SOLVER.AMP.ENABLED=True needs the model on a CUDA device"):
        Trainer(cfg)
