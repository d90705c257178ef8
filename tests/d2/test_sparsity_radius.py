"""SSN's radius in detectron2's trainer (``hooks.SparsityRadius``): set before every iteration, linear from
SOLVER.SSN_RADIUS's start to its end over the schedule; the layers record the iteration they fixed their
weights at; a training resumed from a checkpoint keeps the radius and the fixed choices and ends where the
uninterrupted one does."""

import copy

import pytest
import torch
from detectron2.config import get_cfg
from detectron2.engine import HookBase, SimpleTrainer
from torch import nn

from sn_detection.d2 import add_sn_config, validate_sn_config
from sn_detection.d2.hooks import SparsityRadius, build_radius_hook
from sn_detection.d2.optimizer import GateClippingSGD, get_optimizer_params
from sn_detection.layers import SparseSwitchableNorm2d, build_norm
from sn_detection.pretraining.config import add_pretrain_config, validate_pretrain_config

MAX_ITER = 12
# logits whose weights become one-hot at different radii: at once (a sparsemax of one entry), on the way,
# at the vertices' distance
LOGITS = ([2.0, 0.5, 0.1], [0.4, 0.3, 0.1], [0.9, 1.0, 1.1])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3)
        self.norms = nn.ModuleList([build_norm("SSN", 8), build_norm("SSN", 8), build_norm("SSN", 8, use_bn=False)])
        with torch.no_grad():
            for norm, logits in zip(self.norms, LOGITS):
                norm.mean_weight.copy_(torch.tensor(logits[: len(norm.mean_weight)]))
                norm.var_weight.copy_(torch.tensor(logits[::-1][: len(norm.var_weight)]))

    def forward(self, x):
        y = self.conv(x)
        for norm in self.norms:
            y = torch.relu(norm(y))
        return {"loss": y.square().mean()}


def batches(start):
    iteration = start
    while True:
        yield torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(iteration))
        iteration += 1


class Radii(HookBase):
    """Records the radius of every SSN layer the forward of each iteration sees."""

    def __init__(self):
        self.seen = []

    def after_step(self):
        self.seen.append([norm.radius.item() for norm in self.trainer.model.norms])


def trainer(model, start, optimizer_state=None):
    optimizer = GateClippingSGD(get_optimizer_params(model, base_lr=0.5), lr=0.5, momentum=0.9)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.SOLVER.MAX_ITER = MAX_ITER
    train = SimpleTrainer(model, batches(start), optimizer)
    radii = Radii()
    train.register_hooks([build_radius_hook(cfg, model), radii])
    return train, radii


def test_the_radius_rises_over_the_schedule_and_the_layers_fix_their_weights():
    model = Net()
    train, radii = trainer(model, 0)
    train.train(0, MAX_ITER)
    torch.testing.assert_close(torch.tensor(radii.seen), torch.arange(MAX_ITER).div(MAX_ITER)[:, None].expand(-1, 3))
    fixed_at = [(norm.mean_fixed_at.item(), norm.var_fixed_at.item()) for norm in model.norms]
    assert fixed_at[0][0] == 0  # one-hot from the start
    # every vector fixed by the iteration whose radius passes sqrt(2/3) (sqrt(1/2) for 2 choices), at the latest
    assert all(0 <= at <= 10 for pair in fixed_at for at in pair), fixed_at
    assert len({at for pair in fixed_at for at in pair}) > 2, fixed_at  # at different iterations
    assert all(norm.mean_fixed.item() >= 0 and norm.var_fixed.item() >= 0 for norm in model.norms)


def test_a_resumed_training_keeps_the_radius_and_the_fixed_choices():
    whole = Net()
    trainer(whole, 0)[0].train(0, MAX_ITER)

    first = Net()
    train, _ = trainer(first, 0)
    train.train(0, 6)
    checkpoint = {"model": copy.deepcopy(first.state_dict()), "optimizer": copy.deepcopy(train.optimizer.state_dict())}
    assert [norm.radius.item() for norm in first.norms] == pytest.approx([5 / MAX_ITER] * 3)
    assert any(norm.mean_fixed.item() >= 0 for norm in first.norms)  # some fixed before the interruption

    resumed = Net()
    resumed.load_state_dict(checkpoint["model"])
    assert [norm.mean_fixed.item() for norm in resumed.norms] == [norm.mean_fixed.item() for norm in first.norms]
    trainer(resumed, 6, checkpoint["optimizer"])[0].train(6, MAX_ITER)
    expected = whole.state_dict()
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=key)


def test_the_hook_is_built_only_for_a_model_with_ssn():
    cfg = get_cfg()
    add_sn_config(cfg)
    assert build_radius_hook(cfg, nn.Sequential(build_norm("SN", 4))) is None
    cfg.SOLVER.SSN_RADIUS = (0.2, 0.6)
    cfg.SOLVER.MAX_ITER = 100
    model = nn.Sequential(build_norm("SyncSSN", 4))
    hook = build_radius_hook(cfg, model)
    assert isinstance(hook, SparsityRadius)
    hook.trainer = type("Trainer", (), {"iter": 50})()
    hook.before_step()
    assert model[0].radius.item() == pytest.approx(0.4) and model[0].iteration.item() == 50
    assert isinstance(model[0], SparseSwitchableNorm2d)


@pytest.mark.parametrize(
    "key, value",
    [("SOLVER.SSN_RADIUS", (0.0,)), ("SOLVER.SSN_RADIUS", (-0.1, 1.0)), ("PRETRAIN.SSN_RADIUS", (0.0, "1"))],
)
def test_a_bad_radius_is_named(key, value):
    cfg = get_cfg()
    add_sn_config(cfg)
    add_pretrain_config(cfg)
    cfg.merge_from_list([key, value])
    validate = validate_pretrain_config if key.startswith("PRETRAIN.") else validate_sn_config
    with pytest.raises(ValueError, match=rf"{key}=.* is invalid: it must be \(start, end\): SSN's radius"):
        validate(cfg)


def test_a_lazy_configs_radius_is_checked_before_training():
    from omegaconf import OmegaConf

    from sn_detection.engine.lazy import ssn_radius

    assert ssn_radius(OmegaConf.create({})) == (0.0, 1.0)
    assert ssn_radius(OmegaConf.create({"ssn_radius": [0.1, 0.9]})) == (0.1, 0.9)
    with pytest.raises(ValueError, match=r"train\.ssn_radius=\(1\.0,\) is invalid: it must be \(start, end\)"):
        ssn_radius(OmegaConf.create({"ssn_radius": [1.0]}))
