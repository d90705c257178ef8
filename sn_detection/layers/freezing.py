"""Freezing a layer whose training-mode forward depends on the batch (SN, SyncSN, DN, MN, BNSR).

A frozen BatchNorm is PyTorch's BatchNorm in evaluation mode with fixed parameters (detectron2 swaps in
``FrozenBatchNorm2d`` for that when it freezes a stage). Our layers are not swapped; they freeze
themselves, keeping their class, parameters, buffers and state-dict keys:

- a layer is ``frozen`` when none of its parameters requires a gradient, which is exactly how
  detectron2's ``ResNet.freeze`` (``MODEL.BACKBONE.FREEZE_AT``, ``freeze_at`` in a LazyConfig) marks a
  frozen stage; ``freeze()`` does the same by hand;
- a frozen layer stays in evaluation mode, also when ``train()`` is called on it or on a parent, and a
  forward in training mode first puts it there (for a model trained without ever calling ``train()``):
  the batch-dependent statistics (SN's BN branch, DN's batch pooling, MN's mode estimates, BNSR's
  moments) are the stored running ones and are no longer updated, while per-sample statistics (IN, LN,
  MN's gates, ...) still come from each sample, exactly as at test time.

Freezing is derived, never stored: every entry point that builds a model with frozen stages (detectron2's
``build_model``, ``DefaultPredictor``, a LazyConfig's ``instantiate``) gets frozen layers, with no step of
ours after the build. A frozen layer takes no part in a batch average either (in evaluation mode it
records nothing). Under TorchScript a scripted layer follows the mode it was scripted in.
"""

import torch
from torch import nn


class FreezableNorm:
    """Mixin for ``nn.Module`` norm layers: frozen while none of their parameters requires a gradient."""

    __jit_unused_properties__ = ["frozen"]  # TorchScript compiles properties otherwise

    @property
    def frozen(self) -> bool:
        """True when no parameter requires a gradient (detectron2's mark of a frozen stage)."""
        return not any(p.requires_grad for p in self.parameters())

    def freeze(self) -> nn.Module:
        """Fix the parameters, and so the running statistics, for good (see the module docstring)."""
        self.requires_grad_(False)
        return self.train(False)

    def train(self, mode: bool = True) -> nn.Module:
        return super().train(mode and not self.frozen)

    @torch.jit.unused
    def _follow_freezing(self) -> None:
        """Leave training mode if frozen: called by the forward, outside TorchScript."""
        if self.training and self.frozen:
            self.train(False)
