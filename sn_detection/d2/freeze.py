"""Make our norms in frozen stages (``MODEL.BACKBONE.FREEZE_AT``) really frozen.

detectron2 freezes the first stages of a ResNet while building it (``ResNet.freeze``): every parameter of
the stem and of the frozen blocks gets ``requires_grad=False``, and BatchNorm layers are swapped for
``FrozenBatchNorm2d``, which normalizes with its stored statistics. Our layers are not swapped, so they
would stay in training mode: SN's BN branch, DN's batch pooling, MN's mode estimates and BNSR would keep
normalizing with the batch's statistics and updating their running buffers.

``freeze_norms(model)`` runs after the model is built and freezes, with ``FreezableNorm.freeze()``, every
norm of ours whose parameters all have ``requires_grad=False``, which is how detectron2 marks a frozen
stage (so modules a user freezes the same way are covered too). Such a layer keeps its class, parameters,
buffers and state-dict keys, and stays in evaluation mode even after ``model.train()``: its
batch-dependent statistics are the stored running ones and are no longer updated (see
``sn_detection.layers.freezing``). Our layers without batch-dependent statistics (GN, MGN, PONO)
behave the same in both modes, and their frozen parameters are all there is to freeze.

``sn_detection.d2.build_model`` and the engine's ``Trainer.build_model`` call it. Whoever builds the model
with detectron2's ``build_model`` calls ``freeze_norms(model)`` afterwards, and again after freezing more
of the model by hand.
"""

from __future__ import annotations

import logging

from torch import nn

from ..layers import FreezableNorm

logger = logging.getLogger(__name__)


def freeze_norms(model: nn.Module) -> list[str]:
    """Freeze each of our norms whose parameters all have requires_grad=False; returns their names."""
    frozen = []
    for name, module in model.named_modules():
        parameters = list(module.parameters())
        if isinstance(module, FreezableNorm) and parameters and not any(p.requires_grad for p in parameters):
            module.freeze()
            frozen.append(name)
    if frozen:
        logger.info("Froze %d norm layer(s) in frozen stages: %s", len(frozen), ", ".join(frozen))
    return frozen
