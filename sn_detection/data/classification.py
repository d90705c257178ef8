"""A deterministic generator of a small image-classification dataset of shapes, for pretraining backbones.

The detection set of ``shapes`` is too small to train a ResNet from scratch in a few minutes; detection
papers instead finetune a backbone pretrained on ImageNet classification. This module provides the
embedded stand-in for ImageNet: 64 x 64 px images, each labelled with the kind of its main shape, drawn
in the detection set's visual domain (its backgrounds, clutter strokes, textures, colours, noise and JPEG
encoding, via the primitives of ``shapes``) so that what a backbone learns here transfers to it.

Classes (``CLASSES``, 24): the five detection categories (circle, triangle, rectangle, star, cross) and
nineteen other kinds (ellipse, semicircle, ring, frame, crescent, pentagon, hexagon, rhombus, trapezoid,
parallelogram, star4, star6, heart, arrow, l_shape, t_shape, chevron, gear, teardrop), some with holes.
More kinds than the detector sees make the backbone learn outlines, corners and topology rather than
five templates, and neighbouring kinds (rectangle / parallelogram / rhombus / trapezoid, star / star4 /
star6 / gear, circle / ellipse / ring) force fine shape cues.

Each image shows its main shape (radius 25-45 % of the image side, near the centre, random rotation,
aspect within its kind, colour and texture, with some contrast to the background under it) on a
detection-style background, with up to two smaller distractor shapes of any kind behind it and up to
one in front, which may occlude at most ``MAX_OCCLUDED_FRACTION`` of it. The label depends only on the
main shape's kind: colour, texture, clutter and distractors are nuisances to be ignored, as in detection.

Layout: the torchvision ``ImageFolder`` layout that ImageNet is distributed in, so that a pretraining
tool reads this set and ImageNet alike::

    <folder>/train/<class>/<index>.jpg
    <folder>/val/<class>/<index>.jpg

``list_image_folder`` reads that layout (classes in sorted order, as ImageFolder numbers them).

Determinism: image i of a split is drawn from its own generator seeded by (split seed, i), and its class
is ``CLASSES[i % len(CLASSES)]``, so splits are balanced and the output does not depend on the order or
number of images generated (nor on how many processes generate them); the same arguments give identical
files. ``prepare_classification_set()`` generates the set once into the data root (see ``cache``) and
verifies it against its manifest on every later use, like the detection set. Only numpy and Pillow are
used (through ``shapes``), so this module runs without detectron2.

    python -m sn_detection.data.classification [--root DIR] [--processes N]   # generate, print the folder
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from .cache import data_root, ensure_folder
from .shapes import CATEGORIES, TEXTURES, add_noise, background, encode_jpeg, rasterize, texture_fill, unit_outline

# Bump when the generator's output changes, so that old caches are regenerated rather than reused.
GENERATOR_VERSION = 1

IMAGE_SIZE = 64
MAIN_RADIUS = (0.25, 0.45)  # of the image side
MAIN_OFFSET = 0.12  # largest offset of the main shape's centre from the image centre, of the side
DISTRACTOR_RADIUS = (0.15, 0.55)  # of the main shape's radius
MAX_DISTRACTORS_BEHIND = 2
MAX_DISTRACTORS_IN_FRONT = 1
MAX_OCCLUDED_FRACTION = 0.3
MIN_CONTRAST = 48.0  # RGB distance between the main shape's colour and the mean background under it
COLOUR_TRIES = 6


@dataclass(frozen=True)
class ClassificationSpec:
    """The generation arguments of the set; they are its cache key."""

    train_seed: int = 11
    train_per_class: int = 1000
    val_seed: int = 12
    val_per_class: int = 50
    image_size: int = IMAGE_SIZE


DEFAULT_SPEC = ClassificationSpec()
DATASET_NAME = "sn_shapes_cls"


# --- outlines ---------------------------------------------------------------------------------------
# An outline is (outer polygon, holes): (V, 2) vertex arrays of a shape of radius ~1 centred at 0.

Outline = tuple[np.ndarray, tuple[np.ndarray, ...]]


def _regular(num_vertices: int, rng: np.random.Generator, jitter: float = 0.0) -> np.ndarray:
    angles = np.arange(num_vertices) * 2 * np.pi / num_vertices + rng.uniform(-jitter, jitter, num_vertices)
    return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def _star(points: int, inner: float) -> np.ndarray:
    radii = np.tile([1.0, inner], points)
    angles = np.arange(2 * points) * np.pi / points
    return np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)


def _ellipse(a: float, b: float, centre=(0.0, 0.0), start=0.0, stop=2 * np.pi, count=48) -> np.ndarray:
    angles = np.linspace(start, stop, count, endpoint=False)
    return np.stack([centre[0] + a * np.cos(angles), centre[1] + b * np.sin(angles)], axis=1)


def _ring(rng: np.random.Generator) -> Outline:
    return _ellipse(1, 1), (_ellipse(*(2 * [rng.uniform(0.45, 0.7)])),)


def _frame(rng: np.random.Generator) -> Outline:
    half_h = rng.uniform(0.7, 1.0)
    inner = rng.uniform(0.5, 0.7)
    outer = np.array([[-1, -half_h], [1, -half_h], [1, half_h], [-1, half_h]], dtype=float)
    return outer, (outer * inner,)


def _crescent(rng: np.random.Generator) -> Outline:
    radius, shift = rng.uniform(0.75, 0.95), rng.uniform(0.35, 0.55)
    return _ellipse(1, 1), (_ellipse(radius, radius, centre=(shift, 0.0)),)


def _gear(rng: np.random.Generator) -> Outline:
    teeth, valley = int(rng.integers(7, 10)), rng.uniform(0.7, 0.8)
    # each tooth: two vertices at radius 1, then two at the valley radius
    angles = np.arange(4 * teeth) * 2 * np.pi / (4 * teeth)
    radii = np.tile([1.0, 1.0, valley, valley], teeth)
    outer = np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)
    hole = rng.uniform(0.2, 0.35)
    return outer, (_ellipse(hole, hole, count=24),)


def _heart(rng: np.random.Generator) -> np.ndarray:
    t = np.linspace(0, 2 * np.pi, 64, endpoint=False)
    x = 16 * np.sin(t) ** 3
    y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))  # image y points down
    return np.stack([x * rng.uniform(0.9, 1.1), y], axis=1)


def _teardrop(rng: np.random.Generator) -> np.ndarray:
    radius, tip = rng.uniform(0.45, 0.6), 1.0
    # the round part, centred below the tip, and the tangents from the tip to it
    centre_y = tip - radius - rng.uniform(0.7, 1.1) * radius
    half = np.arccos(radius / (tip - centre_y))
    arc = _ellipse(radius, radius, centre=(0.0, centre_y), start=np.pi / 2 + half, stop=2.5 * np.pi - half, count=40)
    return np.concatenate([arc, [[0.0, tip]]])


def _arrow(rng: np.random.Generator) -> np.ndarray:
    shaft, head, neck = rng.uniform(0.15, 0.28), rng.uniform(0.45, 0.7), rng.uniform(0.05, 0.35)
    return np.array(
        [[-1, -shaft], [neck, -shaft], [neck, -head], [1, 0], [neck, head], [neck, shaft], [-1, shaft]], dtype=float
    )


def _l_shape(rng: np.random.Generator) -> np.ndarray:
    arm, foot = rng.uniform(0.3, 0.45), rng.uniform(0.6, 1.0)
    return np.array([[0, 0], [foot, 0], [foot, arm], [arm, arm], [arm, 1], [0, 1]], dtype=float)


def _t_shape(rng: np.random.Generator) -> np.ndarray:
    bar, stem = rng.uniform(0.3, 0.5), rng.uniform(0.15, 0.28)
    top = -1 + bar
    return np.array(
        [[-1, -1], [1, -1], [1, top], [stem, top], [stem, 1], [-stem, 1], [-stem, top], [-1, top]], dtype=float
    )


def _chevron(rng: np.random.Generator) -> np.ndarray:
    thickness, depth = rng.uniform(0.35, 0.6), rng.uniform(0.7, 1.1)
    return np.array(
        [[-1, 0], [0, -depth], [1, 0], [1, thickness], [0, thickness - depth], [-1, thickness]], dtype=float
    )


def _trapezoid(rng: np.random.Generator) -> np.ndarray:
    top, half_h = rng.uniform(0.3, 0.65), rng.uniform(0.45, 0.8)
    return np.array([[-1, half_h], [1, half_h], [top, -half_h], [-top, -half_h]], dtype=float)


def _parallelogram(rng: np.random.Generator) -> np.ndarray:
    shear, half_h = rng.uniform(0.3, 0.6), rng.uniform(0.35, 0.6)
    return np.array([[-1 + shear, -half_h], [1 + shear, -half_h], [1 - shear, half_h], [-1 - shear, half_h]])


def _rhombus(rng: np.random.Generator) -> np.ndarray:
    half_minor = rng.uniform(0.4, 0.7)
    return np.array([[1, 0], [0, half_minor], [-1, 0], [0, -half_minor]], dtype=float)


def _plain(build: Callable[[np.random.Generator], np.ndarray]) -> Callable[[np.random.Generator], Outline]:
    return lambda rng: (build(rng), ())


_EXTRA_OUTLINES: dict[str, Callable[[np.random.Generator], Outline]] = {
    "ellipse": _plain(lambda rng: _ellipse(1, rng.uniform(0.4, 0.65))),
    "semicircle": _plain(lambda rng: _ellipse(1, 1, start=0, stop=np.pi, count=25)),
    "ring": _ring,
    "frame": _frame,
    "crescent": _crescent,
    "pentagon": _plain(lambda rng: _regular(5, rng, jitter=0.08)),
    "hexagon": _plain(lambda rng: _regular(6, rng, jitter=0.06)),
    "rhombus": _plain(_rhombus),
    "trapezoid": _plain(_trapezoid),
    "parallelogram": _plain(_parallelogram),
    "star4": _plain(lambda rng: _star(4, rng.uniform(0.3, 0.45))),
    "star6": _plain(lambda rng: _star(6, rng.uniform(0.5, 0.65))),
    "heart": _plain(_heart),
    "arrow": _plain(_arrow),
    "l_shape": _plain(_l_shape),
    "t_shape": _plain(_t_shape),
    "chevron": _plain(_chevron),
    "gear": _gear,
    "teardrop": _plain(_teardrop),
}

CLASSES: tuple[str, ...] = CATEGORIES + tuple(_EXTRA_OUTLINES)


def _normalised(outline: Outline) -> Outline:
    """The outline moved so that its outer polygon's box is centred at 0 and scaled to radius 1."""
    outer, holes = outline
    centre = (outer.min(axis=0) + outer.max(axis=0)) / 2
    scale = np.linalg.norm(outer - centre, axis=1).max()
    return (outer - centre) / scale, tuple((hole - centre) / scale for hole in holes)


def class_outline(name: str, rng: np.random.Generator) -> Outline:
    """The outline (outer polygon, holes) of a shape of kind `name`, radius 1, centred at 0."""
    if name in CATEGORIES:
        return _normalised((unit_outline(name, rng), ()))
    if name not in _EXTRA_OUTLINES:
        raise ValueError(f"unknown shape kind {name!r}; valid: {CLASSES}")
    return _normalised(_EXTRA_OUTLINES[name](rng))


# --- images -----------------------------------------------------------------------------------------


def _shape_mask(rng: np.random.Generator, name: str, radius: float, centre: np.ndarray, size: int) -> np.ndarray:
    outer, holes = class_outline(name, rng)
    theta = rng.uniform(0, 2 * np.pi)
    rotation = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    # a random mirror image too: orientation is no cue to the kind
    mirror = np.diag([1.0, -1.0 if rng.random() < 0.5 else 1.0])
    transform = (rotation @ mirror).T * radius
    mask = rasterize(outer @ transform + centre, size, size)
    for hole in holes:
        mask &= ~rasterize(hole @ transform + centre, size, size)
    return mask


def _fill(rng: np.random.Generator, image: np.ndarray, mask: np.ndarray, contrast: bool = False) -> None:
    """Paints `mask` with a random colour and texture; with `contrast`, a colour that stands out from the
    image under the mask (best of a few draws)."""
    size = image.shape[0]
    colour = rng.uniform(0, 255, 3)
    if contrast and mask.any():
        under = image[mask].mean(axis=0)
        for _ in range(COLOUR_TRIES - 1):
            if np.linalg.norm(colour - under) >= MIN_CONTRAST:
                break
            colour = rng.uniform(0, 255, 3)
    kind = str(rng.choice(TEXTURES))
    image[mask] = texture_fill(rng, kind, colour, size, size)[mask]


def _distractor(rng: np.random.Generator, main_radius: float, size: int) -> np.ndarray:
    name = CLASSES[int(rng.integers(len(CLASSES)))]
    radius = rng.uniform(*DISTRACTOR_RADIUS) * main_radius
    return _shape_mask(rng, name, radius, rng.uniform(0, size, 2), size)


def render_sample(seed: int, index: int, image_size: int = IMAGE_SIZE) -> tuple[bytes, int]:
    """Image `index` of the split seeded with `seed`: (JPEG bytes, class index into CLASSES)."""
    rng = np.random.default_rng([seed, index])
    label = index % len(CLASSES)
    size = image_size
    image = background(rng, size, size)
    main_radius = rng.uniform(*MAIN_RADIUS) * size
    behind = int(rng.integers(0, MAX_DISTRACTORS_BEHIND + 1))
    in_front = int(rng.integers(0, MAX_DISTRACTORS_IN_FRONT + 1))
    for _ in range(behind):
        _fill(rng, image, _distractor(rng, main_radius, size))
    centre = size / 2 + rng.uniform(-MAIN_OFFSET, MAIN_OFFSET, 2) * size
    main = _shape_mask(rng, CLASSES[label], main_radius, centre, size)
    _fill(rng, image, main, contrast=True)
    for _ in range(in_front):
        occluder = _distractor(rng, main_radius, size)
        if (main & occluder).sum() <= MAX_OCCLUDED_FRACTION * main.sum():
            _fill(rng, image, occluder)
    return encode_jpeg(add_noise(rng, image)), label


# --- the ImageFolder layout -------------------------------------------------------------------------


def _write_images(folder: str, seed: int, indices: range, image_size: int) -> None:
    for index in indices:
        jpeg, label = render_sample(seed, index, image_size)
        with open(os.path.join(folder, CLASSES[label], f"{index:06d}.jpg"), "wb") as f:
            f.write(jpeg)


def write_split(folder: str, seed: int, per_class: int, image_size: int = IMAGE_SIZE, processes: int = 1) -> None:
    """Writes `per_class` images of each class into `folder`/<class>/<index>.jpg (the same files for any
    number of `processes`)."""
    for name in CLASSES:
        os.makedirs(os.path.join(folder, name), exist_ok=True)
    total = per_class * len(CLASSES)
    if processes <= 1:
        _write_images(folder, seed, range(total), image_size)
        return
    chunks = [range(start, total, processes) for start in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        for done in [pool.submit(_write_images, folder, seed, chunk, image_size) for chunk in chunks]:
            done.result()


def write_classification_set(folder: str, spec: ClassificationSpec = DEFAULT_SPEC, processes: int = 1) -> None:
    """Writes the train and val splits of `spec` into `folder`/train and `folder`/val."""
    write_split(os.path.join(folder, "train"), spec.train_seed, spec.train_per_class, spec.image_size, processes)
    write_split(os.path.join(folder, "val"), spec.val_seed, spec.val_per_class, spec.image_size, processes)


def classification_folder(root: str, spec: ClassificationSpec = DEFAULT_SPEC) -> str:
    suffix = "" if spec == DEFAULT_SPEC else "-" + "-".join(str(v) for v in asdict(spec).values())
    return os.path.join(root, f"{DATASET_NAME}-v{GENERATOR_VERSION}{suffix}")


def prepare_classification_set(
    root: str | None = None, spec: ClassificationSpec = DEFAULT_SPEC, processes: int | None = None
) -> str:
    """The folder of the classification set under `root` (default: the data root), generated first if its
    cache is missing or damaged; its ImageFolder roots are `<folder>/train` and `<folder>/val`.
    Generation uses `processes` processes (default: all CPUs; the files are the same for any number)."""
    root = root or data_root()
    key = {"name": DATASET_NAME, "version": GENERATOR_VERSION, "classes": list(CLASSES), **asdict(spec)}
    processes = processes or os.cpu_count() or 1
    try:
        return ensure_folder(
            classification_folder(root, spec), key, lambda folder: write_classification_set(folder, spec, processes)
        )
    except OSError as error:
        raise OSError(
            f"cannot generate the classification set in {root} ({error}); point SN_DETECTION_DATA at a writable folder"
        ) from error


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".tif", ".tiff", ".webp")


def list_image_folder(split_root: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, samples) of an ImageFolder split `split_root`/<class>/<image>: classes are the
    sub-folder names in sorted order, samples (path, class index) sorted by class then file name, as
    torchvision's ImageFolder numbers and lists them. Works for this set and for ImageNet alike."""
    classes = sorted(entry.name for entry in os.scandir(split_root) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"{split_root} has no class sub-folders (expected <split>/<class>/<image>)")
    samples = []
    for index, name in enumerate(classes):
        class_dir = os.path.join(split_root, name)
        for file_name in sorted(os.listdir(class_dir)):
            if file_name.lower().endswith(IMAGE_EXTENSIONS):
                samples.append((os.path.join(class_dir, file_name), index))
    if not samples:
        raise FileNotFoundError(
            f"{split_root} has class sub-folders but no images in them (files ending in "
            f"{', '.join(IMAGE_EXTENSIONS)}, in any case)"
        )
    return classes, samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="data root (default: $SN_DETECTION_DATA or ~/.cache/sn_detection/datasets)")
    parser.add_argument("--processes", type=int, help="generating processes (default: all CPUs)")
    args = parser.parse_args(argv)
    print(prepare_classification_set(args.root, processes=args.processes))


if __name__ == "__main__":
    main()
