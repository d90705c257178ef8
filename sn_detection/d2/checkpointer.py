"""``CheckedCheckpointer``: detectron2's ``DetectionCheckpointer`` that loads with clear errors and never
saves NaN or Inf.

Loading (``MODEL.WEIGHTS``, or the last checkpoint when resuming). detectron2's checkpointer fails with a
bare AssertionError on a missing file and with whatever pickle or torch raise on a file that is no
checkpoint (``invalid load key``, ``Ran out of input``, ...), and it loads a checkpoint none of whose
tensors fit the model with warnings only: training then starts from scratch without saying so. This one
loads exactly as detectron2 does (model-zoo pickles, the matching heuristics, partial loads that warn
about missing, unexpected or mis-shaped keys, as when finetuning with another number of classes) and
raises instead:

- ``FileNotFoundError`` for a local file that does not exist;
- ``ValueError`` for a file that no reader takes, or whose model entry is not a dict of tensors (the
  training checkpoint of another code base, say);
- ``ValueError`` when not one tensor of the checkpoint loads into the model: a checkpoint of another
  architecture, or an ImageNet model that ``tools/convert_pretrained.py`` has not converted;
- ``ValueError`` for a file whose norms were folded for inference (``folding``) into a model that is not;
- ``ValueError`` when a layer of ours in the file is of another norm or options than the model's (the
  identity each saves, ``layers.base``; detectron2's own loader fails there too, with torch's
  RuntimeError), listing every such layer;
- ``ValueError`` when resuming from, or evaluating (``evaluate_from``), a checkpoint that is not of this
  very model (a tensor or a layer's identity missing, unexpected or of another shape), or evaluating
  none: a run continues only
  with the config that made it, and a model is evaluated only with all its trained tensors, where
  detectron2 would go on with a partly loaded or untrained model (or fail deep in the optimizer's state).

Saving. detectron2's trainer stops with ``FloatingPointError("Loss became infinite or NaN at
iteration=...")`` when the loss is not finite, before the optimizer step. Non-finite *gradients* behind a
finite loss (an overflow in the backward, an absurd learning rate) pass that check: the step writes NaN
or Inf into the weights, and the checkpoint of that iteration (model_final.pth at the last one) would
hold them; running statistics can also become non-finite in a forward. ``save`` refuses such a state and
raises ``FloatingPointError`` naming the iteration and the first non-finite tensors, writing nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import contextmanager
from urllib.parse import urlparse

import numpy as np
import torch
from detectron2.checkpoint import DetectionCheckpointer
from torch import nn

from ..layers import IDENTITY_KEY
from .folding import FoldedModelError, check_loadable

_EXAMPLES = 3  # keys quoted in a message
_NAMES_SHOWN = 5  # non-finite tensors named in a message


def non_finite_entries(model: nn.Module) -> list[str]:
    """The state-dict keys of ``model`` whose floating-point tensors hold a NaN or an Inf."""
    return [
        key
        for key, value in model.state_dict().items()
        if value.is_floating_point() and not bool(value.isfinite().all())
    ]


class CheckedCheckpointer(DetectionCheckpointer):
    """``DetectionCheckpointer`` whose loading fails clearly and whose saving refuses NaN and Inf (see the
    module docstring)."""

    _loading = None  # the path being loaded, for messages
    _whole_for = None  # what a load that must fit every tensor is for ("resume from", "evaluate"), for messages

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

    def load(self, path, *args, **kwargs):
        if path and not urlparse(path).scheme:  # a local file (URLs are fetched by detectron2)
            local = urlparse(path)._replace(query="").geturl()
            if not os.path.isfile(local):
                raise FileNotFoundError(f"checkpoint {local} does not exist")
        self._loading = path
        try:
            return super().load(path, *args, **kwargs)
        finally:
            self._loading = None

    def resume_or_load(self, path, *, resume=True):
        with self._whole("resume from" if resume and self.has_checkpoint() else None):
            return super().resume_or_load(path, resume=resume)

    def evaluate_from(self, path: str, source: str) -> dict:
        """Load ``path`` (named ``source`` in messages: a config key) to evaluate the model."""
        if not path:
            raise ValueError(
                f"there are no weights to evaluate: {source} is empty; give it the trained checkpoint "
                "(OUTPUT_DIR/model_final.pth, say)"
            )
        with self._whole("evaluate"):
            return self.load(path)

    @contextmanager
    def _whole(self, purpose):
        """Loads within must fit every tensor of the model, for ``purpose`` (None: any partial load)."""
        self._whole_for = purpose
        try:
            yield
        finally:
            self._whole_for = None

    def _load_file(self, filename):
        try:
            checkpoint = super()._load_file(filename)
        except OSError:  # unreadable: the system's message names the file and the reason
            raise
        except Exception as error:  # pickle and torch raise many types for a file of the wrong kind
            raise ValueError(f"{filename} is not a checkpoint: {_first_line(error)}") from error
        _check_weights(filename, checkpoint["model"])
        return checkpoint

    def _load_model(self, checkpoint):
        saved = {key.removeprefix("module.") for key in checkpoint["model"]}  # detectron2 strips DDP's prefix
        try:
            check_loadable(saved, self.model, self._loading)
        except FoldedModelError as error:
            raise ValueError(str(error)) from error
        try:
            incompatible = super()._load_model(checkpoint)
        except RuntimeError as error:  # torch's load_state_dict: our layers' identities differ (``layers.base``)
            if not self._whole_for:
                raise ValueError(f"cannot load weights from {self._loading}: {error}") from error
            raise ValueError(
                f"cannot {self._whole_for} {self._loading}: it is not a checkpoint of this model: "
                f"{error}\n{self._remedy()}"
            ) from error
        # detectron2 takes pixel_mean / pixel_std from the config when the checkpoint lacks them
        from_config = set(dict(self.model.named_buffers(recurse=False)))
        model_keys = set(self.model.state_dict())
        # identities the file lacks: not reported by torch (``layers.base``), not loaded either
        unchecked = {key for key in model_keys if key.endswith(IDENTITY_KEY)} - saved
        shaped = {key for key, _, _ in incompatible.incorrect_shapes}  # also reported missing: not loaded
        if model_keys <= set(incompatible.missing_keys) | from_config | unchecked | shaped:
            raise ValueError(
                f"no tensor of {self._loading} fits the model{_mismatches(incompatible)}. Is it a "
                "checkpoint of another architecture, or an ImageNet model to convert with "
                "tools/convert_pretrained.py?"
            )
        if self._whole_for:
            self._check_whole(incompatible, model_keys, from_config, unchecked, shaped)
        return incompatible

    def _check_whole(self, incompatible, model_keys: set, from_config: set, unchecked: set, shaped: set) -> None:
        """Every tensor of the model loaded, of its shape, and nothing else in the file (module docstring).
        Not counted: buffers that are no weights of this model -- those taken from the config, those it does
        not save (pixel_mean / pixel_std, which other detectron2 versions saved) and, when evaluating,
        BatchNorm's training counter, which converted checkpoints lack and FrozenBN has not (a resumed run
        needs it: its absence means another norm). Counted: the ``unchecked`` identities of our layers that
        the file lacks, which detectron2 does not report (``layers.base``): BatchNorm's tensors would
        load into BNSR, GN's into PONO."""
        unsaved = {name for name, _ in self.model.named_buffers()} - model_keys
        no_weights = unsaved | from_config
        counter = self._whole_for == "evaluate"

        def counts(key: str) -> bool:
            return key not in no_weights and not (counter and key.endswith("num_batches_tracked"))

        missing = ({key for key in incompatible.missing_keys if counts(key)} | unchecked) - shaped
        unexpected = [key for key in incompatible.unexpected_keys if counts(key)]
        if not (missing or unexpected or shaped):
            return
        raise ValueError(
            f"cannot {self._whole_for} {self._loading}: it is not a checkpoint of this model"
            f"{_mismatches(incompatible, missing, unexpected)}. {self._remedy()}"
        )

    def _remedy(self) -> str:
        if self._whole_for == "resume from":
            return (
                "Resume with the config that made it, or train afresh (without --resume, or into another output folder)"
            )
        return (
            "To evaluate a training run, give its checkpoint (MODEL.WEIGHTS OUTPUT_DIR/model_final.pth, or "
            "--resume); a file trained with another config needs that config"
        )


def _check_weights(filename: str, weights) -> None:
    """The model entry of a checkpoint must map names to tensors (or numpy arrays: model-zoo pickles)."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"{filename} holds a {type(weights).__name__}, not a dict of model weights")
    for key, value in weights.items():
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise ValueError(
                f"{filename} holds no model weights detectron2 can load: its entry {key!r} is a "
                f"{type(value).__name__}, not a tensor (a checkpoint of another code base? ImageNet models are "
                "converted by tools/convert_pretrained.py)"
            )


def _mismatches(incompatible, missing=(), unexpected=None) -> str:
    """What did not fit, for the message: the ``missing`` keys, the ``unexpected`` ones (by default all
    that ``incompatible`` names) and those of another shape."""
    unexpected = incompatible.unexpected_keys if unexpected is None else unexpected
    parts = [f"{len(missing)} keys of the model it lacks (e.g. {_examples(sorted(missing))})"] if missing else []
    if unexpected:
        parts.append(f"{len(unexpected)} keys the model does not have (e.g. {_examples(unexpected)})")
    if incompatible.incorrect_shapes:
        shapes = [
            f"{key} ({tuple(theirs)} in the file, {tuple(ours)} in the model)"
            for key, theirs, ours in incompatible.incorrect_shapes
        ]
        parts.append(f"{len(shapes)} of another shape (e.g. {_examples(shapes)})")
    return ": " + "; ".join(parts) if parts else ""


def _examples(keys) -> str:
    keys = list(keys)
    return ", ".join(str(key) for key in keys[:_EXAMPLES]) + (", ..." if len(keys) > _EXAMPLES else "")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def check_resumed_iteration(start_iter: int, max_iter: int, key: str, folder: str) -> None:
    """A resumed run must not start past its last iteration (``key``), where it would train nothing."""
    if start_iter > max_iter:
        raise ValueError(
            f"the last checkpoint in {folder} is at iteration {start_iter - 1}, past {key}={max_iter}: raise "
            f"{key} to train on, or train afresh (without --resume, or into another output folder)"
        )
