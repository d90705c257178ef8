"""A training whose loss or weights stop being finite stops with a message naming the iteration and
what is not finite, and leaves no model_final.pth (sn_detection.d2.checkpointer)."""

import math

import numpy as np
import pytest
import torch
from detectron2.engine import HookBase
from shrunk_training import shrunk_cfg

from sn_detection.d2.checkpointer import non_finite_entries
from sn_detection.engine import Trainer

# 2 iterations: the failure comes at the last, whose checkpoint is model_final.pth
OPTS = ["SOLVER.MAX_ITER", "2", "SEED", "1"]
CLASSIFIER = "roi_heads.box_predictor.cls_score.weight"


class BeforeStep(HookBase):
    """Calls ``action(model)`` before iteration ``iteration``."""

    def __init__(self, iteration, action):
        self._iteration = iteration
        self._action = action

    def before_step(self):
        if self.trainer.iter == self._iteration:
            self._action(self.trainer.model)


def train(output_dir, action):
    trainer = Trainer(shrunk_cfg(output_dir, *OPTS))
    trainer.register_hooks([BeforeStep(1, action)])
    trainer.resume_or_load(resume=False)
    trainer.train()


def classifier(model):
    return model.get_parameter(CLASSIFIER)


def test_a_non_finite_loss_stops_training_naming_the_iteration_and_the_loss(tmp_path):
    def corrupt_classifier(model):
        with torch.no_grad():
            classifier(model)[0, 0] = math.nan

    with pytest.raises(FloatingPointError, match=r"iteration=1") as error:
        train(tmp_path, corrupt_classifier)
    nan = repr(np.float64(math.nan))  # detectron2 prints numpy scalars: 'nan', or 'np.float64(nan)' with numpy 2
    assert f"'loss_cls': {nan}" in str(error.value)
    assert f"'loss_mask': {nan}" not in str(error.value)  # only the affected loss is named as NaN
    assert not (tmp_path / "model_final.pth").exists()
    assert not (tmp_path / "last_checkpoint").exists()


def test_non_finite_weights_behind_a_finite_loss_are_not_checkpointed(tmp_path):
    """A NaN gradient with a finite loss passes detectron2's loss check; the optimizer step writes NaN
    into the weights, and the checkpoint of that (last) iteration is refused."""

    def poison_gradient(model):
        classifier(model).register_hook(lambda grad: torch.full_like(grad, math.nan))

    with pytest.raises(FloatingPointError, match=rf"'model_final' at iteration 1: .*NaN or Inf in {CLASSIFIER}$"):
        train(tmp_path, poison_gradient)
    assert not (tmp_path / "model_final.pth").exists()


def test_non_finite_entries_names_parameters_and_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert non_finite_entries(model) == []
    with torch.no_grad():
        model[0].bias[1] = math.inf
    model[1].running_var[0] = math.nan
    assert non_finite_entries(model) == ["0.bias", "1.running_var"]
