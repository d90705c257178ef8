"""A deterministic generator of a small COCO-format instance-segmentation dataset of shapes.

Each image (128-320 px a side) shows one to six shapes of five categories on a textured, cluttered
background. Shapes vary in size, rotation, aspect, colour and texture (solid, stripes, checks, speckle,
gradient), overlap and occlude one another, and may be cut by the image border. Annotations are the
*visible* part of each shape: an exact RLE mask, with its tight box and area taken from that mask.

Image i of a split is drawn from its own generator seeded by (split seed, i): the output does not depend
on the order or number of images generated, and the same arguments always give identical files.
Only numpy, Pillow and pycocotools are used, so this module runs without detectron2.

The drawing primitives (``unit_outline``, ``rasterize``, ``texture_fill``, ``background``,
``add_noise``, ``encode_jpeg``) are public: the classification set of ``classification`` draws its
images with them, so that both datasets share one visual domain.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass

import numpy as np
import pycocotools.mask as mask_util
from PIL import Image, ImageDraw

CATEGORIES = ("circle", "triangle", "rectangle", "star", "cross")
TEXTURES = ("solid", "stripes", "checks", "speckle", "gradient")
NOISE_STD = 6.0
MIN_VISIBLE_PIXELS = 40
MIN_VISIBLE_FRACTION = 0.4
JPEG_QUALITY = 92


@dataclass(frozen=True)
class Shape:
    category_id: int
    vertices: np.ndarray  # (V, 2) polygon in pixel coordinates (x, y)
    colour: np.ndarray  # (3,) RGB in [0, 255]
    texture: str


def unit_outline(name: str, rng: np.random.Generator) -> np.ndarray:
    """Vertices of a shape of radius ~1 centred at 0, before rotation and scaling."""
    if name == "circle":
        angles = np.linspace(0, 2 * np.pi, 48, endpoint=False)
        return np.stack([np.cos(angles), np.sin(angles)], axis=1)
    if name == "triangle":
        angles = np.array([0.0, 2 * np.pi / 3, 4 * np.pi / 3]) + rng.uniform(-0.35, 0.35, 3)
        return np.stack([np.cos(angles), np.sin(angles)], axis=1)
    if name == "rectangle":
        half_h = rng.uniform(0.35, 0.9)
        return np.array([[-1, -half_h], [1, -half_h], [1, half_h], [-1, half_h]], dtype=float)
    if name == "star":
        radii = np.tile([1.0, rng.uniform(0.38, 0.55)], 5)
        angles = np.arange(10) * np.pi / 5
        return np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)
    if name == "cross":
        w = rng.uniform(0.25, 0.4)
        return np.array(
            [
                [-w, -1],
                [w, -1],
                [w, -w],
                [1, -w],
                [1, w],
                [w, w],
                [w, 1],
                [-w, 1],
                [-w, w],
                [-1, w],
                [-1, -w],
                [-w, -w],
            ],
            dtype=float,
        )
    raise ValueError(f"unknown shape {name!r}; valid: {CATEGORIES}")


def _random_shape(rng: np.random.Generator, width: int, height: int) -> Shape:
    category = int(rng.integers(len(CATEGORIES)))
    outline = unit_outline(CATEGORIES[category], rng)
    radius = rng.uniform(10, 0.4 * min(width, height))
    theta = rng.uniform(0, 2 * np.pi)
    rotation = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    centre = rng.uniform([0, 0], [width, height])
    vertices = outline @ rotation.T * radius + centre
    colour = rng.uniform(0, 255, 3)
    texture = str(rng.choice(TEXTURES))
    return Shape(category + 1, vertices, colour, texture)


def rasterize(vertices: np.ndarray, width: int, height: int) -> np.ndarray:
    """The (height, width) boolean mask of a polygon given by its (V, 2) vertices (x, y)."""
    canvas = Image.new("L", (width, height), 0)
    ImageDraw.Draw(canvas).polygon([tuple(v) for v in vertices], fill=1)
    return np.asarray(canvas, dtype=bool)


def texture_fill(rng: np.random.Generator, kind: str, colour: np.ndarray, width: int, height: int) -> np.ndarray:
    """An (H, W, 3) float image of `colour` modulated by a pattern of the given kind."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    if kind == "solid":
        pattern = np.ones_like(xs)
    elif kind == "stripes":
        angle, period = rng.uniform(0, np.pi), rng.uniform(4, 14)
        phase = (xs * np.cos(angle) + ys * np.sin(angle)) / period
        pattern = 0.65 + 0.35 * (np.floor(phase) % 2)
    elif kind == "checks":
        cell = rng.uniform(4, 12)
        pattern = 0.65 + 0.35 * ((np.floor(xs / cell) + np.floor(ys / cell)) % 2)
    elif kind == "speckle":
        pattern = rng.uniform(0.6, 1.0, size=xs.shape).astype(np.float32)
    elif kind == "gradient":
        angle = rng.uniform(0, 2 * np.pi)
        ramp = xs * np.cos(angle) + ys * np.sin(angle)
        pattern = 0.5 + 0.5 * (ramp - ramp.min()) / max(float(np.ptp(ramp)), 1.0)
    else:
        raise ValueError(f"unknown texture {kind!r}")
    return pattern[..., None] * colour[None, None, :].astype(np.float32)


def background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A smooth colour field with a few unannotated clutter strokes, so the detector must look at shape."""
    corners = rng.uniform(40, 215, size=(2, 2, 3)).astype(np.float32)
    fy = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    fx = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    image = (
        corners[0, 0] * (1 - fy) * (1 - fx)
        + corners[0, 1] * (1 - fy) * fx
        + corners[1, 0] * fy * (1 - fx)
        + corners[1, 1] * fy * fx
    )
    canvas = Image.fromarray(image.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(0, 6))):
        x0, x1 = rng.uniform(0, width, 2)
        y0, y1 = rng.uniform(0, height, 2)
        colour = tuple(int(c) for c in rng.uniform(0, 255, 3))
        draw.line([(x0, y0), (x1, y1)], fill=colour, width=int(rng.integers(1, 4)))
    return np.asarray(canvas, dtype=np.float32)


def _place_shapes(rng: np.random.Generator, width: int, height: int) -> tuple[list[Shape], list[np.ndarray]]:
    """Shapes in drawing order with their full masks; every shape keeps enough of itself visible."""
    wanted = int(rng.integers(1, 7))
    shapes, masks = [], []
    for _ in range(4 * wanted):
        if len(shapes) == wanted:
            break
        shape = _random_shape(rng, width, height)
        mask = rasterize(shape.vertices, width, height)
        if mask.sum() < MIN_VISIBLE_PIXELS / MIN_VISIBLE_FRACTION:
            continue
        if all(_is_visible(visible & ~mask, full) for visible, full in zip(_visible_masks(masks), masks)):
            shapes.append(shape)
            masks.append(mask)
    return shapes, masks


def _visible_masks(masks: list[np.ndarray]) -> list[np.ndarray]:
    """Each mask minus the masks drawn after it."""
    visible, covered = [], np.zeros_like(masks[0]) if masks else None
    for mask in reversed(masks):
        visible.append(mask & ~covered)
        covered = covered | mask
    return visible[::-1]


def _is_visible(visible: np.ndarray, full: np.ndarray) -> bool:
    count = int(visible.sum())
    return count >= MIN_VISIBLE_PIXELS and count >= MIN_VISIBLE_FRACTION * int(full.sum())


def add_noise(rng: np.random.Generator, image: np.ndarray) -> np.ndarray:
    """The float image with Gaussian pixel noise (std NOISE_STD) added in place."""
    image += rng.normal(0, NOISE_STD, size=image.shape)
    return image


def encode_jpeg(image: np.ndarray) -> bytes:
    """An (H, W, 3) float RGB image, clipped to [0, 255], as JPEG bytes (quality JPEG_QUALITY)."""
    buffer = io.BytesIO()
    Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def _encode_rle(mask: np.ndarray) -> dict:
    rle = mask_util.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"size": [int(s) for s in rle["size"]], "counts": rle["counts"].decode("ascii")}


def render_image(seed: int, index: int) -> tuple[bytes, int, int, list[dict]]:
    """One JPEG image and its annotations (without ids): (jpeg_bytes, width, height, annotations)."""
    rng = np.random.default_rng([seed, index])
    width, height = (int(v) for v in rng.integers(128, 321, size=2))
    image = background(rng, width, height)
    shapes, masks = _place_shapes(rng, width, height)
    for shape, mask in zip(shapes, masks):
        image[mask] = texture_fill(rng, shape.texture, shape.colour, width, height)[mask]
    jpeg = encode_jpeg(add_noise(rng, image))

    annotations = []
    for shape, visible in zip(shapes, _visible_masks(masks)):
        rle = _encode_rle(visible)
        encoded = {"size": rle["size"], "counts": rle["counts"].encode("ascii")}
        annotations.append(
            {
                "category_id": shape.category_id,
                "segmentation": rle,
                "bbox": [float(v) for v in mask_util.toBbox(encoded)],
                "area": float(mask_util.area(encoded)),
                "iscrowd": 0,
            }
        )
    return jpeg, width, height, annotations


def write_split(out_dir: str, seed: int, num_images: int) -> str:
    """Writes `images/*.jpg` and `annotations.json` (COCO instances format) into out_dir; returns the json path."""
    image_dir = os.path.join(out_dir, "images")
    os.makedirs(image_dir, exist_ok=True)
    images, annotations = [], []
    for index in range(num_images):
        jpeg, width, height, image_annotations = render_image(seed, index)
        file_name = f"{index:06d}.jpg"
        with open(os.path.join(image_dir, file_name), "wb") as f:
            f.write(jpeg)
        image_id = index + 1
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        for annotation in image_annotations:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, **annotation})
    coco = {
        "info": {"description": f"sn_detection shapes, seed {seed}"},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(CATEGORIES)],
    }
    json_path = os.path.join(out_dir, "annotations.json")
    with open(json_path, "w") as f:
        json.dump(coco, f)
    return json_path
