"""MODEL.WEIGHTS given to training that cannot be what the user meant stops the trainer before its first
iteration, with the file and the problem named (sn_detection.d2.checkpoint, the trainer's checkpointer)."""

import pytest
import torch
from shrunk_training import shrunk_cfg

from sn_detection.engine import Trainer


def trainer_with_weights(tmp_path, weights):
    return Trainer(shrunk_cfg(tmp_path / "output", "MODEL.WEIGHTS", str(weights), "SOLVER.MAX_ITER", "1"))


def test_missing_weights_stop_training(tmp_path):
    trainer = trainer_with_weights(tmp_path, tmp_path / "R-50.pkl")
    with pytest.raises(FileNotFoundError, match=f"checkpoint {tmp_path / 'R-50.pkl'} does not exist"):
        trainer.resume_or_load(resume=False)


def test_weights_that_fit_nothing_stop_training(tmp_path):
    """An ImageNet ResNet in torchvision's names, not converted."""
    weights = tmp_path / "resnet18.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7), "fc.bias": torch.zeros(1000)}, weights)
    trainer = trainer_with_weights(tmp_path, weights)
    with pytest.raises(ValueError, match=f"no tensor of {weights} fits the model"):
        trainer.resume_or_load(resume=False)
