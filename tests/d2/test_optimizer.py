"""Optimizer parameter groups: SOLVER.WEIGHT_DECAY_NORM for our norms' affine parameters, the gate rule
(SOLVER.GATE_WEIGHT_DECAY, lr x SOLVER.GATE_LR_FACTOR) for SN's logits, DN's gates and MN's / MGN's
gate, SSN's (lr x SOLVER.SSN_GATE_LR_FACTOR, gradients clipped to SOLVER.SSN_GATE_CLIP_NORM), detectron2's
rules for everything else."""

import pytest
import torch
from detectron2.config import get_cfg
from detectron2.solver import build_lr_scheduler
from torch import nn

from sn_detection.d2 import add_sn_config, build_optimizer, get_optimizer_params
from sn_detection.d2.optimizer import GateClippingSGD, clip_gate_gradients
from sn_detection.engine import Trainer
from sn_detection.layers import NORM_CLASSES, NORM_NAMES, build_norm, gate_parameter_names

BASE_LR, WEIGHT_DECAY, WEIGHT_DECAY_NORM, GATE_WEIGHT_DECAY, GATE_LR_FACTOR = 0.02, 1e-4, 2e-5, 3e-6, 0.1
SSN_GATE_LR_FACTOR = 0.05
SPARSE = ("SSN", "SyncSSN")


def solver_cfg(*opts):
    cfg = get_cfg()
    add_sn_config(cfg)
    cfg.merge_from_list(
        [
            "SOLVER.BASE_LR",
            BASE_LR,
            "SOLVER.WEIGHT_DECAY",
            WEIGHT_DECAY,
            "SOLVER.WEIGHT_DECAY_NORM",
            WEIGHT_DECAY_NORM,
            "SOLVER.GATE_WEIGHT_DECAY",
            GATE_WEIGHT_DECAY,
            "SOLVER.GATE_LR_FACTOR",
            GATE_LR_FACTOR,
            "SOLVER.SSN_GATE_LR_FACTOR",
            SSN_GATE_LR_FACTOR,
            *opts,
        ]
    )
    return cfg


def network():
    """A conv, each of our norms, detectron2-known norms, a linear layer and a frozen norm."""
    layers = {name: build_norm(name, 32) for name in NORM_NAMES}
    layers.update(conv=nn.Conv2d(32, 32, 3), bn=nn.BatchNorm2d(32), fc=nn.Linear(32, 4), frozen=build_norm("SN", 32))
    layers["frozen"].requires_grad_(False)
    return nn.ModuleDict(layers)


def hyperparameters(optimizer):
    """Parameter -> (lr, weight decay) of its group; checks each parameter is in exactly one group."""
    found = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert param not in found
            found[param] = (group["lr"], group["weight_decay"])
    return found


def test_every_parameter_of_our_norms_is_affine_or_a_gate_the_layer_names():
    for name in NORM_NAMES:
        layer = build_norm(name, 32)
        assert isinstance(layer, NORM_CLASSES)
        names = {n for n, _ in layer.named_parameters()}
        assert names - set(gate_parameter_names(layer)) == {"weight", "bias"}, name
        assert set(gate_parameter_names(layer)) <= names, name
    assert gate_parameter_names(nn.Conv2d(3, 3, 1)) == () and gate_parameter_names(nn.BatchNorm2d(3)) == ()


def test_groups_hold_the_norm_and_gate_rules():
    model = network()
    found = hyperparameters(build_optimizer(solver_cfg(), model))

    gates = 0
    for name in NORM_NAMES:
        for param_name, param in model[name].named_parameters():
            if param_name in gate_parameter_names(model[name]):
                gates += 1
                factor = SSN_GATE_LR_FACTOR if name in SPARSE else GATE_LR_FACTOR
                assert found[param] == pytest.approx((BASE_LR * factor, GATE_WEIGHT_DECAY)), (name, param_name)
            else:
                assert found[param] == (BASE_LR, WEIGHT_DECAY_NORM), (name, param_name)
    assert gates == 7 * 2  # SN, SyncSN, SSN, SyncSSN, DN, MGN, MN: two each
    for param in model["bn"].parameters():
        assert found[param] == (BASE_LR, WEIGHT_DECAY_NORM)
    for param in (*model["conv"].parameters(), *model["fc"].parameters()):
        assert found[param] == (BASE_LR, WEIGHT_DECAY)
    assert not any(p in found for p in model["frozen"].parameters())
    assert len(found) == sum(p.requires_grad for p in model.parameters())


def test_detectron2s_bias_rules_still_apply_to_our_norms_biases():
    model = network()
    cfg = solver_cfg("SOLVER.WEIGHT_DECAY_BIAS", 5e-5, "SOLVER.BIAS_LR_FACTOR", 2.0)
    found = hyperparameters(build_optimizer(cfg, model))
    assert found[model["SN"].bias] == (2 * BASE_LR, 5e-5)
    assert found[model["SN"].weight] == (BASE_LR, WEIGHT_DECAY_NORM)
    assert found[model["bn"].bias] == (2 * BASE_LR, 5e-5)
    assert found[model["MN"].gate.bias] == pytest.approx((BASE_LR * GATE_LR_FACTOR, GATE_WEIGHT_DECAY))
    assert found[model["conv"].bias] == (2 * BASE_LR, 5e-5)


def test_few_groups_sgd_settings_and_gradient_clipping():
    cfg = solver_cfg("SOLVER.MOMENTUM", 0.8, "SOLVER.NESTEROV", True, "SOLVER.CLIP_GRADIENTS.ENABLED", True)
    optimizer = build_optimizer(cfg, network())
    assert len(optimizer.param_groups) == 4  # default, norm, gate, SSN's gate
    assert all(g["momentum"] == 0.8 and g["nesterov"] for g in optimizer.param_groups)
    assert isinstance(optimizer, torch.optim.SGD) and type(optimizer) is not torch.optim.SGD


def test_the_schedule_keeps_the_gate_lr_factor():
    cfg = solver_cfg("SOLVER.WARMUP_ITERS", 10, "SOLVER.STEPS", (3,), "SOLVER.MAX_ITER", 20)
    model = network()
    optimizer = build_optimizer(cfg, model)
    scheduler = build_lr_scheduler(cfg, optimizer)
    gate_group = next(g for g in optimizer.param_groups if any(p is model["SN"].mean_weight for p in g["params"]))
    conv_group = next(g for g in optimizer.param_groups if any(p is model["conv"].weight for p in g["params"]))
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        assert gate_group["lr"] == pytest.approx(GATE_LR_FACTOR * conv_group["lr"])
    assert conv_group["lr"] < BASE_LR


def test_plain_arguments_give_the_groups_of_the_config():
    """What a LazyConfig sets (configs/lazy) is what a yaml config sets."""
    model = network()
    params = get_optimizer_params(
        model,
        base_lr=BASE_LR,
        weight_decay_norm=WEIGHT_DECAY_NORM,
        gate_lr_factor=GATE_LR_FACTOR,
        gate_weight_decay=GATE_WEIGHT_DECAY,
        ssn_gate_lr_factor=SSN_GATE_LR_FACTOR,
    )
    optimizer = GateClippingSGD(params, lr=BASE_LR, momentum=0.9, weight_decay=WEIGHT_DECAY)
    assert hyperparameters(optimizer) == hyperparameters(build_optimizer(solver_cfg(), model))


def test_the_trainer_builds_this_optimizer():
    model, cfg = network(), solver_cfg()
    assert hyperparameters(Trainer.build_optimizer(cfg, model)) == hyperparameters(build_optimizer(cfg, model))


@pytest.mark.parametrize("option", ["gate_lr_factor", "gate_weight_decay", "ssn_gate_lr_factor", "ssn_gate_clip_norm"])
@pytest.mark.parametrize("value", [-1.0, float("inf")])
def test_plain_gate_arguments_follow_the_config_keys_rules(option, value):
    """A LazyConfig passes these directly: a negative LR factor would make the gates climb the loss."""
    with pytest.raises(
        ValueError, match=f"get_optimizer_params: {option}={value!r} is invalid: it must be a number >= 0"
    ):
        get_optimizer_params(build_norm("SN", 8), base_lr=0.02, **{option: value})


def test_ssn_gates_get_the_authors_rules_by_default():
    """A tenth of the learning rate, no weight decay, gradients clipped to a total norm of 1."""
    cfg = get_cfg()
    add_sn_config(cfg)
    model = network()
    optimizer = build_optimizer(cfg, model)
    assert isinstance(optimizer, GateClippingSGD)
    sparse_gates = {id(model[name].mean_weight) for name in SPARSE} | {id(model[name].var_weight) for name in SPARSE}
    for group in optimizer.param_groups:
        if {id(p) for p in group["params"]} & sparse_gates:
            assert {id(p) for p in group["params"]} == sparse_gates  # one group, clipped together
            assert group["lr"] == pytest.approx(0.1 * cfg.SOLVER.BASE_LR) and group["weight_decay"] == 0
            assert group["clip_norm"] == 1.0
        else:
            assert "clip_norm" not in group
    groups = get_optimizer_params(model, base_lr=0.02, ssn_gate_clip_norm=0.0)
    assert not any("clip_norm" in group for group in groups)  # 0: no clip


def clipped_model():
    model = nn.ModuleDict({"ssn": build_norm("SSN", 4), "other": build_norm("SSN", 4), "sn": build_norm("SN", 4)})
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 3
    return model


def test_the_step_clips_the_ssn_gates_total_norm_and_nothing_else():
    model = clipped_model()
    optimizer = GateClippingSGD(get_optimizer_params(model, base_lr=1.0), lr=1.0)
    gates = [model[name].mean_weight for name in ("ssn", "other")] + [
        model[name].var_weight for name in ("ssn", "other")
    ]
    grads = [g.grad.clone() for g in gates]
    norm = torch.linalg.vector_norm(torch.cat(grads))
    assert norm > 1
    untouched = {p: p.grad.clone() for p in model.parameters() if all(p is not g for g in gates)}
    before = [g.detach().clone() for g in gates]
    optimizer.step()
    for gate, grad, old in zip(gates, grads, before):
        # the step took lr x factor (0.1) x the gradient scaled to a total norm of 1
        torch.testing.assert_close(gate.detach(), old - 0.1 * grad / (norm + 1e-6))
    assert all(torch.equal(p.grad, grad) for p, grad in untouched.items())


def test_a_gradient_scale_clips_the_unscaled_gradients():
    model, scaled = clipped_model(), clipped_model()
    for p in scaled.parameters():
        p.grad *= 1024
    params = get_optimizer_params(model, base_lr=1.0)
    clip_gate_gradients(torch.optim.SGD(params, lr=1.0))
    clip_gate_gradients(torch.optim.SGD(get_optimizer_params(scaled, base_lr=1.0), lr=1.0), torch.tensor(1024.0))
    for p, q in zip(model.parameters(), scaled.parameters()):
        torch.testing.assert_close(q.grad, 1024 * p.grad)
