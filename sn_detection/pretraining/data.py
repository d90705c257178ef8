"""The images of image-classification pretraining: an ImageFolder (``train/<class>/*``, ``val/<class>/*``,
ImageNet's layout) or the embedded classification set (``sn_detection.data.classification``, generated and
cached on first use), as detectron2 feeds a detector: 0-255 pixels in the config's INPUT.FORMAT.

Augmentation is deterministic per sample: the training stream yields (image index, seed) pairs, the seed
drawn from (SEED, position in the global stream), and each sample's random crop and flip come from a
generator seeded with it. So a run resumed at iteration k reads exactly the samples, crops and flips of
an uninterrupted one, with any number of loader workers, and K processes read those of one.

- training: a random crop of ``CROP_AREA`` of the image's area with aspect ratio in [3/4, 4/3] (10
  draws, then the largest central crop), resized to ``IMAGE_SIZE``, flipped horizontally half the time
  (the "random resized crop" of ImageNet training);
- validation: the shorter side resized to ``IMAGE_SIZE / 0.875`` and the central ``IMAGE_SIZE`` square.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from ..data.classification import list_image_folder, prepare_classification_set

EMBEDDED = "embedded"
VAL_CROP_FRACTION = 0.875
ASPECT_RANGE = (3 / 4, 4 / 3)
CROP_DRAWS = 10


def data_folder(data: str) -> str:
    """The folder holding train/ and val/ for PRETRAIN.DATA: the embedded set (generated if needed) or
    the given folder, checked."""
    folder = prepare_classification_set() if data == EMBEDDED else data
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(folder, split)):
            raise FileNotFoundError(
                f"PRETRAIN.DATA={data!r}: {os.path.join(folder, split)} is not a folder; PRETRAIN.DATA is "
                f"{EMBEDDED!r} or an ImageFolder directory with train/<class>/* and val/<class>/* (ImageNet's layout)"
            )
    return folder


class ClassificationImages(Dataset):
    """The split ``split`` of an ImageFolder ``folder``: item ``(index, seed)`` (training) or ``index``
    (validation) is (uint8 image (3, S, S) in ``image_format`` channel order, class index)."""

    def __init__(self, folder: str, split: str, image_size: int, crop_area=(0.08, 1.0), image_format: str = "BGR"):
        if image_format not in ("BGR", "RGB"):
            raise ValueError(f"INPUT.FORMAT={image_format!r}: pretraining reads BGR or RGB images")
        self.classes, self.samples = list_image_folder(os.path.join(folder, split))
        self.image_size = image_size
        self.crop_area = tuple(crop_area)
        self.image_format = image_format

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item):
        index, seed = item if isinstance(item, tuple) else (item, None)
        path, label = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("RGB")
            image = self._central(image) if seed is None else self._augmented(image, seed)
        pixels = np.asarray(image)
        if self.image_format == "BGR":
            pixels = pixels[:, :, ::-1]
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))), label

    def _augmented(self, image: Image.Image, seed: int) -> Image.Image:
        rng = np.random.default_rng(seed)
        width, height = image.size
        box = _central_box(width, height, 1.0)
        for _ in range(CROP_DRAWS):
            area = width * height * rng.uniform(*self.crop_area)
            aspect = math.exp(rng.uniform(*np.log(ASPECT_RANGE)))
            w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < w <= width and 0 < h <= height:
                left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
                box = (left, top, left + w, top + h)
                break
        crop = image.resize((self.image_size, self.image_size), Image.BILINEAR, box=box)
        return crop.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop

    def _central(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        resized = self.image_size / VAL_CROP_FRACTION / min(width, height)
        side = self.image_size / resized  # the central square, in the image's pixels
        box = _central_box(width, height, side / min(width, height))
        return image.resize((self.image_size, self.image_size), Image.BILINEAR, box=box)


def _central_box(width: int, height: int, fraction: float) -> tuple[float, float, float, float]:
    """The central square whose side is ``fraction`` of the shorter side."""
    side = min(width, height) * fraction
    left, top = (width - side) / 2, (height - side) / 2
    return (left, top, left + side, top + side)


def sample_seed(seed: int, position: int) -> int:
    """The augmentation seed of the sample at ``position`` of the global stream."""
    return int(np.random.SeedSequence([seed, position]).generate_state(1)[0])


class SeededStream(Sampler):
    """This process's infinite stream of (index, augmentation seed), from its sample ``start`` on.

    ``sampler`` is this process's share of an infinite stream of indices, as detectron2's
    ``TrainingSampler`` gives it: positions rank, rank + K, rank + 2K, ... of one global permutation
    stream for K processes. The seed is that of the sample's global position, so K processes with
    batches of B / K read exactly the samples, crops and flips of one process with batches of B."""

    def __init__(self, sampler: Sampler, seed: int, rank: int, world_size: int, start: int = 0):
        self._sampler, self._seed, self._rank, self._world_size, self._start = sampler, seed, rank, world_size, start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices = itertools.islice(self._sampler, self._start, None)
        for position, index in enumerate(indices, self._start):
            yield int(index), sample_seed(self._seed, position * self._world_size + self._rank)


def collate(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*batch)
    return torch.stack(images), torch.tensor(labels)


def shard(length: int, rank: int, world_size: int) -> list[int]:
    """The validation indices of process ``rank``: every world_size-th, from ``rank``."""
    return list(range(rank, length, world_size))
