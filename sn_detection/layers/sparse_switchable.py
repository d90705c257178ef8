"""Sparse Switchable Normalization (Shao, Meng, Li, Zhang, Li, Wang, Luo, CVPR 2019): SN whose importance weights
come from SparsestMax instead of a softmax, so that each layer ends as exactly one of IN, LN and BN.

    y = gamma * (x - sum_k w_k mu_k) / sqrt(sum_k w'_k var_k + eps) + beta,   k in [IN, LN, BN]

with w = SparsestMax(mean_weight, r), w' = SparsestMax(var_weight, r): everything else is SN's
(``switchable``: the statistics, the running statistics, the batch average, SyncSN's pooling, the fused
kernels). SparsestMax(z, r) of K = 3 logits (2 without the BN branch), centre u = (1/K, ..., 1/K):

1. w = sparsemax(z), the Euclidean projection of z onto the simplex: w_i = max(z_i - tau, 0), tau =
   (sum_{i in S} z_i - 1) / |S| over the support S = {i : 1 + c_i z_i > sum_{j : z_j >= z_i} z_j}, c_i the
   number of entries >= z_i (the sorted form's condition 1 + k z_(k) > sum_{j<=k} z_(j), for every entry at once);
2. if |w - u| >= r the result is w; otherwise p = u + r (w - u) / |w - u|, on the circle of radius r;
3. if p left the simplex (an entry < 0), it goes to the point of the edge between its two largest entries at
   distance r from u: (1 + s) / 2, (1 - s) / 2 and 0 with s = sqrt(2 r^2 - 1/3); the result is clipped to
   [0, 1]. From r >= sqrt(2/3) (the vertices' distance to u) every result is one-hot: the one-hot vector of
   the largest logit, exactly (near that radius the steps' rounding would leave 1e-8 on another entry).

The radius r is the buffer ``radius``: 0 (sparsemax) until the training schedule sets it (``set_radius``;
detectron2's trainer and the pretraining tool raise it linearly from 0 to 1 over the iterations, as the
authors' code). Once the mean (or variance) weights of a training forward are one-hot (largest minus smallest
>= 1, the authors' test) they are fixed: the buffer ``mean_fixed`` (``var_fixed``) holds the chosen branch
(0 IN, 1 LN, 2 BN; -1 while free) and ``mean_fixed_at`` (``var_fixed_at``) the iteration the schedule had set
(-1 if none); from then on the weights are that one-hot vector and the logits get no gradient (0).

Choices the paper leaves open, and how they are settled here:

- Ties go to the earlier branch in [IN, LN, BN]. With all logits equal the sparsemax is the centre itself and
  the direction of step 2 is undefined: the point moves towards IN (so that r >= sqrt(2/3) gives a one-hot
  result whatever the logits); at equal logits the result does not depend on them, so they get no gradient
  (at r = 0 the result is the sparsemax, u, with the sparsemax's gradient). The two largest entries of step 3
  are the two largest logits, the earlier branch first among equal ones, and the largest gets (1 + s) / 2.
- No epsilon in step 2's division (the authors add 1e-6 to |w - u|): the point lies exactly on the circle.
- Without the BN branch (2 choices) the centre is (1/2, 1/2) (the authors' code keeps 1/3, a slip), the
  simplex is a segment whose "edge" is a vertex: step 3 is the clip to [0, 1], and from r >= sqrt(1/2) every
  result is one-hot.
- The layer fixes its weights in training forwards, empty batches included (the choice depends on the
  logits and the radius, not on the data, and the processes of SyncSSN must agree); not while a batch
  average runs on the kernel path, nor in a forward replayed for a double backward, nor under TorchScript
  (the scripted layer uses the fixed weights but fixes none). On the kernel path the forward kernel fixes
  them, with no host read. Off it (the CPU, float64) the layer reads its few buffers on the host: once both
  weights are fixed, its torch path computes only the chosen statistics (``used_branches``), e.g. no LN or BN
  statistics (nor BN's running update) for an IN layer, while the kernels compute the same result as a
  mixture with one-hot weights. On a GPU without the kernels, under Triton's interpreter (which stands for
  a device), and in a traced or compiled graph, the torch path computes the mixture as well (a host read
  would wait for the device, or be baked into the graph).
- Logits initialised to 1 like SN's (the authors' code), so the weights start at the centre.
- Buffers, beside SN's: ``radius`` (float, shape ()), ``mean_fixed``, ``var_fixed``, ``mean_fixed_at``,
  ``var_fixed_at`` and ``iteration`` (the one the schedule set last; int64, shape ()), all saved in state
  dicts. ``conversion.ssn_imagenet`` converts the authors' layout (a 0/1 flag per fixed weight vector,
  logits set to one-hot values when fixed).

``branch_weights`` is plain tensor operations (comparisons, sums, ``where``; no branch on a value, no host
read), so that it exports (ONNX, torch.export, TorchScript) as it trains.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .fused import is_replaying
from .group import GroupNorm2d
from .inference import ChannelAffine, EvaluationForm
from .kernels import interpreting, kernel_path
from .map_passes import stat_dtype
from .options import is_number
from .switchable import SwitchableNorm2d, SyncSwitchableNorm2d

FREE = -1  # mean_fixed / var_fixed of weights that are not fixed, *_fixed_at of an unknown iteration
IN_BRANCH, LN_BRANCH, BN_BRANCH = range(3)


def sparsemax(logits: Tensor) -> Tensor:
    """The Euclidean projection of ``logits`` (..., K) onto the simplex (Martins & Astudillo, 2016), with
    the support found by comparing every pair of entries (module docstring, step 1)."""
    z = logits - logits.amax(-1, keepdim=True)  # exact for equal logits: the centre comes out exactly
    at_least = (z.unsqueeze(-2) >= z.unsqueeze(-1)).to(z.dtype)  # [..., i, j]: z_j >= z_i
    count = at_least.sum(-1)
    total = (at_least * z.unsqueeze(-2)).sum(-1)
    support = 1 + count * z > total
    size = support.to(z.dtype).sum(-1, keepdim=True)
    tau = (torch.where(support, z, 0).sum(-1, keepdim=True) - 1) / size
    return torch.where(support, (z - tau).clamp(min=0), 0)


def branch_ranks(logits: Tensor) -> Tensor:
    """The place of each entry of ``logits`` (..., K) in descending order, the earlier entry first among equal
    ones: 0 for the largest."""
    k = logits.shape[-1]
    above = logits.unsqueeze(-2) > logits.unsqueeze(-1)  # [..., i, j]: z_j > z_i
    index = torch.arange(k, device=logits.device)
    earlier = (logits.unsqueeze(-2) == logits.unsqueeze(-1)) & (index < index.unsqueeze(-1))
    return (above | earlier).to(torch.int64).sum(-1)


def sparsestmax(logits: Tensor, radius: Tensor) -> Tensor:
    """SparsestMax(logits, radius) over the last dimension of ``logits`` (..., K), K = 2 or 3, with the
    module docstring's steps and tie rules; ``radius`` a scalar tensor. Plain differentiable operations."""
    k = logits.shape[-1]
    if k not in (2, 3):
        raise ValueError(f"SparsestMax takes 2 or 3 logits ([IN, LN] or [IN, LN, BN]), got {k}")
    w = sparsemax(logits)
    centre = 1.0 / k
    diff = w - centre
    squared = diff.square().sum(-1, keepdim=True)
    at_centre = squared == 0
    distance = torch.where(at_centre, 1, squared).sqrt()  # never the square root of 0 (its gradient)
    first = (torch.arange(k, device=w.device) == 0).to(w.dtype)
    towards_first = (first - centre) / math.sqrt((k - 1) / k)
    direction = torch.where(at_centre, towards_first, diff / distance)
    inside = torch.where(at_centre, 0, distance) < radius
    p = centre + radius * direction
    ranks = branch_ranks(logits)
    if k == 3:
        half_chord = (2 * radius.square() - 1 / 3).clamp(min=0).sqrt()
        edge = torch.where(ranks == 0, (1 + half_chord) / 2, torch.where(ranks == 1, (1 - half_chord) / 2, 0))
        p = torch.where(p.amin(-1, keepdim=True) < 0, edge, p)
    weights = torch.where(inside, p, w).clamp(0, 1)
    # from the vertices' distance to the centre on, the one-hot vector of the largest logit, exactly (the
    # steps above round near that radius)
    return torch.where(radius >= math.sqrt((k - 1) / k), (ranks == 0).to(w.dtype), weights)


def fixed_or(weights: Tensor, fixed: Tensor) -> Tensor:
    """``weights`` (..., K) where ``fixed`` (...) is FREE, else the one-hot vector of the branch ``fixed``."""
    index = torch.arange(weights.shape[-1], device=weights.device)
    one_hot = (index == fixed.unsqueeze(-1)).to(weights.dtype)
    return torch.where(fixed.unsqueeze(-1) >= 0, one_hot, weights)


class SparseSwitchableNorm2d(SwitchableNorm2d):
    """Sparse Switchable Normalization over (N, C, H, W) inputs; see the module docstring."""

    option_rules = dict(SwitchableNorm2d.option_rules)  # its own: the identity names the class that declares them
    branch_mapping = "sparsestmax"  # the mapping from logits to weights in the fused kernels

    def __init__(self, num_channels: int, *, eps: float = 1e-5, momentum: float | None = 0.1, use_bn: bool = True):
        super().__init__(num_channels, eps=eps, momentum=momentum, use_bn=use_bn)
        self.register_buffer("radius", torch.zeros(()))
        for name in ("mean_fixed", "var_fixed", "mean_fixed_at", "var_fixed_at"):
            self.register_buffer(name, torch.full((), FREE, dtype=torch.int64))
        self.register_buffer("iteration", torch.full((), FREE, dtype=torch.int64))

    def reset_parameters(self) -> None:
        """SN's (logits 1: the centre), radius 0, nothing fixed."""
        super().reset_parameters()
        if "radius" in self._buffers:  # SN's constructor resets before the buffers exist
            self.radius.zero_()
            for name in ("mean_fixed", "var_fixed", "mean_fixed_at", "var_fixed_at", "iteration"):
                self._buffers[name].fill_(FREE)
            self.clear_call_plans()

    def set_radius(self, radius: float, iteration: int = FREE) -> None:
        """The radius r of SparsestMax from now on, set by the schedule before ``iteration`` (recorded where
        the weights become one-hot; FREE: none)."""
        if not (is_number(radius) and radius >= 0):
            raise ValueError(f"{type(self).__name__}: radius={radius!r} is invalid: it must be a number >= 0")
        self.radius.fill_(radius)
        self.iteration.fill_(iteration)

    @torch.jit.unused
    def sparsity_buffers(self) -> tuple[Tensor, ...]:
        """``(radius, iteration, mean_fixed, var_fixed, mean_fixed_at, var_fixed_at)``, read from the buffer dict
        (for the kernels: attribute lookups cost a layer call host time)."""
        b = self._buffers
        return b["radius"], b["iteration"], b["mean_fixed"], b["var_fixed"], b["mean_fixed_at"], b["var_fixed_at"]

    def branch_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The importance weights of the branches [IN, LN(, BN)] for the means and for the variances, in
        ``dtype``: SparsestMax(mean_weight, radius), SparsestMax(var_weight, radius), or the one-hot vector of
        the branch a fixed one chose."""
        weights = self._weights_of(self.mean_weight, self.var_weight, dtype)
        return weights[0], weights[1]

    def _weights_of(self, mean_logits: Tensor, var_logits: Tensor, dtype: torch.dtype) -> Tensor:
        """The (2, K) weights of these logits (in the statistics' dtype even for fp16 logits)."""
        logits = torch.stack([mean_logits, var_logits]).to(dtype)
        fixed = torch.stack([self.mean_fixed, self.var_fixed])
        return fixed_or(sparsestmax(logits, self.radius.to(dtype)), fixed)

    def logit_gradients(
        self, mean_weights: Tensor, var_weights: Tensor, grad_mean_weights: Tensor, grad_var_weights: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The gradients of ``mean_weight`` and ``var_weight`` from those of the weights: the vector-Jacobian
        product of ``branch_weights`` (0 for fixed weights), by autograd through its few operations."""
        with torch.enable_grad():
            logits = [self.mean_weight.detach().requires_grad_(), self.var_weight.detach().requires_grad_()]
            weights = self._weights_of(*logits, mean_weights.dtype)
            grad = torch.stack([grad_mean_weights, grad_var_weights]).to(weights.dtype)
            grads = torch.autograd.grad(weights, logits, grad)
        return grads[0], grads[1]

    def used_branches(self) -> list[bool]:
        """Every branch the layer has; where both weights are fixed and the host reads them without waiting
        for a device (module docstring), only the chosen ones."""
        used = [True, True, self.use_bn]
        if not torch.jit.is_scripting():
            chosen = self.chosen_branches()
            if chosen is not None:
                used = [chosen[0] == k or chosen[1] == k for k in range(3)]
        return used

    def evaluation_form(self) -> EvaluationForm:
        """At inference (``inference``), once both weights are fixed on one branch, the one normalizer chosen: IN
        is GN with a group per channel, LN is GN with one group (its statistics pool every channel and pixel
        of a sample), BN is a ``ChannelAffine`` of the running statistics; otherwise (free weights, or mean
        and variance from two branches) SN's form with its weights as constants, which computes only the
        branches they use (``switchable.FrozenSwitchableNorm2d``)."""
        chosen = int(self.mean_fixed), int(self.var_fixed)
        if chosen[0] != chosen[1] or chosen[0] == FREE:
            return super().evaluation_form()
        if chosen[0] == BN_BRANCH:
            affine = ChannelAffine.of_statistics(self.running_mean, self.running_var, self.weight, self.bias, self.eps)
            return EvaluationForm(affine, None)
        groups = self.num_channels if chosen[0] == IN_BRANCH else 1
        group_norm = GroupNorm2d(self.num_channels, num_groups=groups, eps=self.eps).to(self.weight.device)
        with torch.no_grad():
            group_norm.weight.copy_(self.weight)
            group_norm.bias.copy_(self.bias)
        return EvaluationForm(None, group_norm.requires_grad_(False).eval())

    @torch.jit.unused
    def chosen_branches(self) -> tuple[int, int] | None:
        """(mean branch, variance branch) once both are fixed, read on the host where that needs no device
        (the buffers on the CPU, eager, and no Triton interpreter standing in for a device); else None."""
        if self.mean_fixed.device.type != "cpu" or interpreting() or _in_graph():
            return None
        mean, var = int(self.mean_fixed), int(self.var_fixed)
        return (mean, var) if mean >= 0 and var >= 0 else None

    @torch.jit.unused
    def fused_plan(self, x: Tensor):
        if not kernel_path(x) and self.chosen_branches() is not None:
            return None  # the torch path, which computes only the chosen statistics
        return super().fused_plan(x)

    @torch.jit.unused
    def autograd_forward(self, x: Tensor, parameters: tuple[Tensor, ...]) -> Tensor:
        self._fix_without_kernels(x)
        return super().autograd_forward(x, parameters)

    @torch.jit.unused
    def exported_forward(self, x: Tensor) -> Tensor:
        self._fix_without_kernels(x)
        return super().exported_forward(x)

    @torch.jit.unused
    def _fix_without_kernels(self, x: Tensor) -> None:
        # the kernels (and SN's closed forms) fix the weights in the forward of a non-empty batch; otherwise the
        # layer does it here (an empty batch too: the choice depends on the logits and the radius, not on the
        # data, and the processes of SyncSSN, one of which may have no image, must agree)
        if self.training and not (x.numel() > 0 and kernel_path(x)) and not is_replaying():
            self.fix_one_hot_weights(stat_dtype(x))

    @torch.jit.unused
    def fix_one_hot_weights(self, dtype: torch.dtype = torch.float32) -> None:
        """Fix the mean and variance weights that are one-hot now (largest minus smallest >= 1, computed in
        ``dtype``), recording the schedule's iteration: the rule of a training forward."""
        fixed, fixed_at = (self.mean_fixed, self.var_fixed), (self.mean_fixed_at, self.var_fixed_at)
        with torch.no_grad():
            weights = self._weights_of(self.mean_weight, self.var_weight, dtype)
            one_hot = weights.amax(-1) - weights.amin(-1) >= 1
            newly = one_hot & (torch.stack(fixed) < 0)
            choice = weights.argmax(-1)
            for i in range(2):
                fixed[i].copy_(torch.where(newly[i], choice[i], fixed[i]))
                fixed_at[i].copy_(torch.where(newly[i], self.iteration, fixed_at[i]))
        if self.mean_fixed.device.type == "cpu" and bool(newly.any()):
            self.clear_call_plans()  # the plans off the kernel path depend on the fixed branches

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        self.clear_call_plans()  # the fixed branches may have changed


class SyncSparseSwitchableNorm2d(SparseSwitchableNorm2d, SyncSwitchableNorm2d):
    """SSN whose BN branch pools statistics over all processes of the default process group, as SyncSN's."""


def sparse_switchable_layers(model: nn.Module) -> list[SparseSwitchableNorm2d]:
    """The SSN (SyncSSN) layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, SparseSwitchableNorm2d)]


def linear_radius(iteration: int, max_iter: int, start: float = 0.0, end: float = 1.0) -> float:
    """The radius before ``iteration`` of a ``max_iter``-iteration training, rising linearly from ``start``
    (iteration 0) towards ``end`` (reached after the last iteration), as the authors' iteration / total."""
    return start + (end - start) * min(max(iteration / max_iter, 0.0), 1.0)


def set_radius(model: nn.Module, radius: float, iteration: int = FREE) -> int:
    """``set_radius(radius, iteration)`` on every SSN layer of ``model``; returns how many there are."""
    layers = sparse_switchable_layers(model)
    for layer in layers:
        layer.set_radius(radius, iteration)
    return len(layers)


def _in_graph() -> bool:
    """Whether the code is being traced or compiled into a graph, where a host read would be baked in."""
    if torch.jit.is_tracing():
        return True
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()
