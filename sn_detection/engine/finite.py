"""No checkpoint with NaN or Inf: a checkpointer that checks the model's state before writing it.

detectron2's trainer stops with ``FloatingPointError("Loss became infinite or NaN at iteration=...")``
and the loss terms when the loss is not finite, before the optimizer step, so the weights of such an
iteration are never saved. Non-finite *gradients* behind a finite loss (an overflow in the backward, an
absurd learning rate) pass that check: the step writes NaN or Inf into the weights, and the checkpoint
of that iteration (model_final.pth at the last one) would hold them; running statistics can also
become non-finite in a forward. ``FiniteCheckpointer`` refuses to save such a state and raises
``FloatingPointError`` naming the iteration and the first non-finite tensors instead.
"""

from __future__ import annotations

from torch import nn

from ..d2.checkpoint import CheckedCheckpointer

_NAMES_SHOWN = 5


def non_finite_entries(model: nn.Module) -> list[str]:
    """The state-dict keys of ``model`` whose floating-point tensors hold a NaN or an Inf."""
    return [
        key
        for key, value in model.state_dict().items()
        if value.is_floating_point() and not bool(value.isfinite().all())
    ]


class FiniteCheckpointer(CheckedCheckpointer):
    """A ``DetectionCheckpointer`` whose ``save`` raises FloatingPointError, writing nothing, when the
    model's parameters or buffers are not all finite (and whose loading fails clearly on a bad file:
    ``sn_detection.d2.checkpoint``)."""

    def save(self, name: str, **kwargs) -> None:
        bad = non_finite_entries(self.model) if self.save_dir and self.save_to_disk else []
        if bad:
            where = f" at iteration {kwargs['iteration']}" if "iteration" in kwargs else ""
            more = f" and {len(bad) - _NAMES_SHOWN} more" if len(bad) > _NAMES_SHOWN else ""
            raise FloatingPointError(
                f"Not saving checkpoint {name!r}{where}: the model holds NaN or Inf in "
                f"{', '.join(bad[:_NAMES_SHOWN])}{more}"
            )
        super().save(name, **kwargs)
