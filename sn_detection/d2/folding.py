"""``fold_norms(model)``: a detectron2 model made as cheap as its norms allow at inference, in place.

Every norm of the model takes its evaluation form (``sn_detection.layers.inference``), and the constant
per-channel affine of a form merges into the convolution before it:

- detectron2's ``FrozenBatchNorm2d``, torch's BatchNorm, DN with its batch gate on and MN with one mode
  vanish into the convolution's weight and bias, as mmcv's ``fuse_conv_bn`` does for BatchNorm;
- BNSR's standardization vanishes likewise, leaving phi_p and its affine;
- DN pooling contiguous groups becomes GN with that many groups;
- every other layer (SN, SyncSN, MN, MGN, GN, PONO, DN with strided groups) stays as it is, frozen: it
  already evaluates as one moments pass and one affine pass.

Where the norms are: a detectron2 ``Conv2d`` applies its ``norm`` right after the convolution (the
backbones, FPN, box and mask heads); an ``nn.Sequential`` holding a convolution then a norm (RetinaNet's
heads) is the same pair. A norm anywhere else takes its form in place, its affine as a module.

A folded model is for inference only. Its outputs are the unfolded model's in evaluation mode up to
float32 rounding (the tests hold them to 1e-5 relative on a whole Mask R-CNN); its parameters are frozen;
a forward in training mode raises ``FoldedModelError``. Its state dict is another model's (convolutions
gain biases, norms lose tensors) and says so: it holds ``folded_norms._extra_state`` (``FoldMarker``), so
that loading it into an unfolded model, or an unfolded state dict into it, fails with a message, in
``load_state_dict`` (strict or not, as for our layers' identities) and in ``CheckedCheckpointer``. Fold
after loading the trained weights: ``fold_norms(model)`` then evaluate or export.
"""

from __future__ import annotations

import torch
from detectron2.layers import FrozenBatchNorm2d
from torch import nn

from ..layers.inference import ChannelAffine, EvaluationForm, evaluation_form, fold_into_conv

MARKER = "folded_norms"  # the marker's attribute on the model, and so its state-dict prefix
MARKER_KEY = f"{MARKER}._extra_state"
_MARK = b"sn_detection.fold_norms"


class FoldedModelError(RuntimeError):
    """A folded model was asked to train, or to hold weights that are not folded."""


def _training_refused(model: nn.Module, _inputs) -> None:
    if model.training:
        raise FoldedModelError(
            "this model's norms are folded for inference (sn_detection.d2.fold_norms): it cannot train. Train the "
            "model as built from its config, then fold it for inference"
        )


class FoldMarker(nn.Module):
    """Marks a folded model in its state dict (module docstring); holds no tensor the model computes with."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(list(_MARK), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Nothing to set: ``_load_from_state_dict`` has checked that the state dict is a folded one."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if prefix + "_extra_state" not in state_dict:
            errors.append(
                "the model's norms are folded for inference (fold_norms), but the state dict is an unfolded "
                "model's: load the trained weights first, then fold"
            )
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


def is_folded(model: nn.Module) -> bool:
    """Whether ``fold_norms`` has folded ``model``."""
    return isinstance(getattr(model, MARKER, None), FoldMarker)


def check_loadable(saved_keys, model: nn.Module, source: str) -> None:
    """Refuse a folded state dict (its keys ``saved_keys``) for a model that is not folded, naming ``source``."""
    if MARKER_KEY in saved_keys and not is_folded(model):
        raise FoldedModelError(
            f"{source} holds a model whose norms were folded for inference (fold_norms): it cannot be loaded to "
            "train or to evaluate unfolded. Load the trained, unfolded checkpoint (and fold it again if needed)"
        )


def _form(norm: nn.Module) -> EvaluationForm | None:
    if isinstance(norm, FrozenBatchNorm2d):
        return EvaluationForm(
            ChannelAffine.of_statistics(norm.running_mean, norm.running_var, norm.weight, norm.bias, norm.eps), None
        )
    return evaluation_form(norm)


def _fold_pair(conv: nn.Conv2d, form: EvaluationForm) -> nn.Module | None:
    """Fold the form's affine into ``conv``; what remains of the norm after it (None: nothing)."""
    if form.affine is not None:
        fold_into_conv(conv, form.affine)
    return form.module


def _as_module(form: EvaluationForm) -> nn.Module:
    parts = [part for part in form if part is not None]
    return parts[0] if len(parts) == 1 else nn.Sequential(*parts) if parts else nn.Identity()


def fold_norms(model: nn.Module) -> nn.Module:
    """Fold the norms of ``model`` for inference, in place, and return it (module docstring). Raises
    ``FoldedModelError`` for a model folded already."""
    if is_folded(model):
        raise FoldedModelError("the model's norms are folded already")
    model.eval()
    done: set[int] = set()
    for module in list(model.modules()):
        if isinstance(module, nn.Conv2d) and isinstance(getattr(module, "norm", None), nn.Module):
            form = _form(module.norm)
            if form is not None:
                done.add(id(module.norm))
                module.norm = _fold_pair(module, form)
        elif isinstance(module, nn.Sequential):
            children = list(module._modules.items())
            for (_, first), (name, second) in zip(children, children[1:]):
                form = _form(second) if isinstance(first, nn.Conv2d) and id(second) not in done else None
                if form is not None:
                    done.add(id(second))
                    module._modules[name] = _fold_pair(first, form) or nn.Identity()
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None or id(child) in done:
                continue
            form = _form(child)
            if form is not None and form != EvaluationForm(None, child):
                parent._modules[name] = _as_module(form)
    model.requires_grad_(False)
    model.add_module(MARKER, FoldMarker())
    model.register_forward_pre_hook(_training_refused)
    return model.eval()
