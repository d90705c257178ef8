"""``DeviceLRSGD``: the step of a ``torch.optim.SGD`` with each group's learning rate read from a device
tensor, so that it can be captured in a CUDA graph and replayed with the rate the schedule has reached
(``graphed_step``).

A replay runs the kernels recorded at capture with the arguments they had then. ``torch.optim.SGD``
hands each group's rate to its kernels as a number, so replayed it would keep the captured rate; its
fused step (``fused=True``) also takes the rate as a one-element float32 tensor, which the kernel reads
when it runs. ``DeviceLRSGD`` is that fused SGD over the parameter groups of an optimizer the schedule
and the checkpoints know (the source), one rate tensor per group on the parameters' device, which
``load_lrs`` sets from the source's groups (``fill_``: the rate is the kernel's argument; nothing is
copied from host memory and the host does not wait). Its momentum buffers are the source's own tensors,
updated in place: the source's ``state_dict``, so a checkpoint, is that of eager steps, and an eager
optimizer continues it.

The update is torch's SGD, per element, with momentum mu, dampening tau, weight decay lambda:
g <- g + lambda theta; b <- mu b + (1 - tau) g; g <- g + mu b with Nesterov, else g <- b; theta <- theta - lr g.
The fused kernel computes it in one pass, the foreach step (torch's default on CUDA) in several passes
over the same formula: the two round in another order and agree to a few ulp per step, not bit for bit.
Under mixed precision ``GradScaler.step`` hands the fused step the scale and the found-inf flag, and the
kernel applies both on the device: a step with a non-finite gradient leaves the weights and the momentum
as they were, as the eager step that the host skips after reading the flag.

The other hyperparameters (momentum, dampening, weight decay, Nesterov, maximize) are numbers in the
recorded kernels, and the momentum buffers their addresses: ``check_unchanged`` refuses a source whose
values or buffers changed since.
"""

from __future__ import annotations

import torch

# the SGD hyperparameters other than the rate, which a captured step keeps as they were at capture
FIXED_HYPERPARAMETERS = ("momentum", "dampening", "weight_decay", "nesterov", "maximize")
_NO_STATE: dict = {}


def has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether some parameters have gradients and every one that has, its momentum buffer where its group has
    momentum: whether the optimizer has made a step (mixed precision skips those with non-finite gradients)
    with the gradients of a training step (a parameter that gets none has no buffer and needs none)."""
    state = optimizer.state
    groups = optimizer.param_groups
    trained = [(group, param) for group in groups for param in group["params"] if param.grad is not None]
    return bool(trained) and all(
        not group["momentum"] or state.get(param, {}).get("momentum_buffer") is not None for group, param in trained
    )


class DeviceLRSGD:
    """torch's fused SGD over the parameter groups and momentum buffers of ``source``, a ``torch.optim.SGD``
    that has stepped (``has_stepped``), with one rate tensor per group (module docstring). ``optimizer`` is
    that fused SGD, which ``GradScaler.step`` takes."""

    def __init__(self, source: torch.optim.Optimizer):
        if not isinstance(source, torch.optim.SGD):
            raise TypeError(f"DeviceLRSGD steps a torch.optim.SGD, not a {type(source).__name__}")
        if not has_stepped(source):
            raise ValueError(
                "the optimizer has not stepped with its parameters' gradients: DeviceLRSGD continues its steps, "
                "with the momentum buffers of the parameters that have gradients"
            )
        self.source = source
        self._fixed = _fixed_hyperparameters(source)
        device = source.param_groups[0]["params"][0].device
        self.lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in source.param_groups]
        groups = [
            {"params": group["params"], "lr": lr, **dict(zip(FIXED_HYPERPARAMETERS, fixed))}
            for group, lr, fixed in zip(source.param_groups, self.lrs, self._fixed)
        ]
        self.optimizer = torch.optim.SGD(groups, lr=0.0, fused=True)
        self._buffers = []
        for group in source.param_groups:
            for param in group["params"]:
                buffer = source.state.get(param, {}).get("momentum_buffer")
                self.optimizer.state[param]["momentum_buffer"] = buffer
                self._buffers.append((param, buffer))

    def load_lrs(self) -> None:
        """Each group's rate tensor gets the source group's ``lr``, as the schedule set it."""
        for lr, group in zip(self.lrs, self.source.param_groups):
            lr.fill_(group["lr"])

    def check_unchanged(self) -> None:
        """Raise a RuntimeError where the source's fixed hyperparameters or momentum buffers are no longer
        those this step was built with (module docstring)."""
        fixed = _fixed_hyperparameters(self.source)
        if fixed != self._fixed:
            raise RuntimeError(
                f"the optimizer's {', '.join(FIXED_HYPERPARAMETERS)} changed from {self._fixed} to {fixed} after the "
                "step was captured, which keeps them as they were"
            )
        state = self.source.state
        if any(state.get(param, _NO_STATE).get("momentum_buffer") is not buffer for param, buffer in self._buffers):
            raise RuntimeError(
                "the optimizer's momentum buffers were replaced after the step was captured (an optimizer "
                "load_state_dict, say): the captured step would update the old ones"
            )


def _fixed_hyperparameters(optimizer: torch.optim.Optimizer) -> list[tuple]:
    return [tuple(group[name] for name in FIXED_HYPERPARAMETERS) for group in optimizer.param_groups]
