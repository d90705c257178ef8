"""Freezing a layer whose training-mode forward depends on the batch (SN, SyncSN, DN, MN, BNSR).

A frozen BatchNorm is PyTorch's BatchNorm in evaluation mode with fixed parameters (detectron2 swaps in
``FrozenBatchNorm2d`` for that). ``FreezableNorm.freeze()`` does the same in place for the layers of this
package, keeping their class, parameters, buffers and state-dict keys:

- the parameters stop requiring gradients;
- the layer stays in evaluation mode, also when ``train()`` is called on it or on a parent: the
  batch-dependent statistics (SN's BN branch, DN's batch pooling, MN's mode estimates, BNSR's
  moments) are the stored running ones and are no longer updated, while the per-sample statistics
  (IN, LN, MN's gates, ...) still come from each sample, exactly as at test time.

A frozen layer takes no part in a batch average either: in evaluation mode it records nothing, so
callers of ``start_batch_average`` / ``finish_batch_average`` skip layers whose ``frozen`` is True.
Freezing is not stored in the state dict: whoever builds the network freezes the layers again.
"""

from torch import nn


class FreezableNorm:
    """Mixin for ``nn.Module`` norm layers: ``freeze()`` fixes the parameters and running statistics."""

    frozen = False

    def freeze(self) -> nn.Module:
        """Fix the parameters and the running statistics for good (see the module docstring)."""
        self.requires_grad_(False)
        self.frozen = True
        return self.train(False)

    def train(self, mode: bool = True) -> nn.Module:
        return super().train(mode and not self.frozen)
