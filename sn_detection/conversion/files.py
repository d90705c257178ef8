"""Reading source checkpoints and writing detectron2 ones.

The output is ``{"model": state_dict, "__author__": ..., "matching_heuristics": True}``, which
``DetectionCheckpointer`` reads in either of two files:

- ``.pkl``: pickled, tensors as numpy arrays: detectron2's model-zoo format (what its
  ``tools/convert-torchvision-to-d2.py`` writes). ``DetectionCheckpointer`` takes a ``.pkl`` holding
  ``"model"`` and ``"__author__"`` as-is; without ``"__author__"`` it would treat the file as a Caffe2
  blob dict and rename the keys, so the author is always set (and is never "Caffe2").
- ``.pth`` / ``.pt``: ``torch.save``d tensors, read with ``torch.load``.

Both set ``matching_heuristics``: the keys are detectron2's ResNet names without a model prefix, and
the checkpointer's suffix matching puts them under ``backbone.bottom_up.`` (FPN) or ``backbone.`` and
``roi_heads.`` (C4). The file appears atomically: it is written to a temporary file in the destination
directory, synced, and moved into place with ``os.replace``, so an interrupted or failed conversion
leaves either the previous file or nothing, never a partial checkpoint.
"""

import contextlib
import os
import pickle
import tempfile
import zipfile
from collections.abc import Mapping

import torch
from torch import Tensor

from .report import ConversionError


def _write_pickle(checkpoint: dict, stream) -> None:
    arrays = {key: tensor.numpy() for key, tensor in checkpoint["model"].items()}
    pickle.dump({**checkpoint, "model": arrays}, stream, protocol=pickle.HIGHEST_PROTOCOL)


def _write_torch(checkpoint: dict, stream) -> None:
    torch.save(checkpoint, stream)


WRITERS = {".pkl": _write_pickle, ".pth": _write_torch, ".pt": _write_torch}


def write_checkpoint(state: Mapping[str, Tensor], path: str, author: str) -> None:
    """Write ``state`` as a detectron2 checkpoint to ``path`` (.pkl, .pth or .pt), atomically; its folder
    is made where missing."""
    suffix = os.path.splitext(path)[1]
    if suffix not in WRITERS:
        raise ConversionError(f"{path}: the output must end in one of {sorted(WRITERS)}")
    checkpoint = {"model": dict(state), "__author__": author, "matching_heuristics": True}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    descriptor, partial = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            WRITERS[suffix](checkpoint, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(partial, 0o666 & ~_umask())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_torch_file(path: str) -> Mapping:
    """``torch.load`` restricted to tensors and plain containers (``weights_only``): a checkpoint is
    data, and a file that needs arbitrary code to unpickle is none of the supported layouts."""
    _require_file(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for a file of the wrong kind
        raise ConversionError(
            f"{path} is not a PyTorch checkpoint (torch.load with weights_only=True failed: {_first_line(error)})"
        ) from error
    if not isinstance(loaded, Mapping):
        raise ConversionError(f"{path} holds a {type(loaded).__name__}, not a dict of tensors")
    return loaded


def load_pickle(path: str) -> Mapping:
    """A Python 2 or 3 pickle of a dict (Detectron's Caffe2 files are Python 2 pickles: latin1)."""
    _require_file(path)
    if zipfile.is_zipfile(path):
        raise ConversionError(f"{path} is a zip archive (torch.save's format), not a pickle")
    try:
        with open(path, "rb") as stream:
            loaded = pickle.load(stream, encoding="latin1")
    except Exception as error:  # pickle raises many types for a file of the wrong kind
        raise ConversionError(f"{path} is not a pickle file ({_first_line(error)})") from error
    if not isinstance(loaded, Mapping):
        raise ConversionError(f"{path} holds a pickled {type(loaded).__name__}, not a dict")
    return loaded


def _require_file(path: str) -> None:
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: no such file")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
