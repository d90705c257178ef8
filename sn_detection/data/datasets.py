"""The embedded shapes dataset, registered with detectron2's catalogs as `sn_shapes_train` / `sn_shapes_val`.

The files are generated on first use into `$SN_DETECTION_DATA` (default `~/.cache/sn_detection/datasets`)
and checked against their manifest on every use; see `cache.py`. Masks are RLE, so configs that train
on these datasets set `INPUT.MASK_FORMAT: bitmask`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from functools import partial

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets import load_coco_json

from .cache import DEFAULT_DATA_ROOT, data_root, ensure_folder
from .shapes import CATEGORIES, write_split

# Bump when the generator's output changes, so old caches are regenerated rather than reused.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class SplitSpec:
    seed: int
    num_images: int


SHAPES_SPLITS = {
    "sn_shapes_train": SplitSpec(seed=1, num_images=1000),
    "sn_shapes_val": SplitSpec(seed=2, num_images=100),
}


def split_folder(name: str, root: str) -> str:
    return os.path.join(root, f"{name}-v{GENERATOR_VERSION}")


def prepare_split(name: str, root: str) -> str:
    """Generates the split under root if its cache is missing or damaged; returns its folder."""
    spec = SHAPES_SPLITS[name]
    key = {"name": name, "version": GENERATOR_VERSION, **asdict(spec)}
    try:
        return ensure_folder(split_folder(name, root), key, partial(_write, spec))
    except OSError as error:
        raise OSError(
            f"cannot generate dataset {name!r} in {root} ({error}); point SN_DETECTION_DATA (default "
            f"{DEFAULT_DATA_ROOT}) at a writable folder"
        ) from error


def _write(spec: SplitSpec, folder: str) -> None:
    write_split(folder, seed=spec.seed, num_images=spec.num_images)


def _load(name: str, root: str) -> list[dict]:
    folder = prepare_split(name, root)
    return load_coco_json(os.path.join(folder, "annotations.json"), os.path.join(folder, "images"), name)


def register_shapes_datasets(root: str | None = None) -> None:
    """Registers every split under root (default: data_root()), lazily: nothing is generated until a
    split is loaded. Names already registered are left as they are, so calling this again is harmless."""
    root = root or data_root()
    for name in SHAPES_SPLITS:
        if name in DatasetCatalog.list():
            continue
        DatasetCatalog.register(name, partial(_load, name, root))
        folder = split_folder(name, root)
        MetadataCatalog.get(name).set(
            thing_classes=list(CATEGORIES),
            json_file=os.path.join(folder, "annotations.json"),
            image_root=os.path.join(folder, "images"),
            evaluator_type="coco",
        )


def check_datasets(names) -> None:
    """Fail now, naming the dataset, when a name is not registered or when the annotation file or the image
    folder its metadata names (as ``register_coco_instances`` sets them) does not exist, rather than when
    it is first loaded (for a test set: after training). The embedded splits are generated when loaded."""
    for name in names:
        if name not in DatasetCatalog.list():
            registered = sorted(DatasetCatalog.list())
            raise ValueError(f"dataset {name!r} is not registered; registered datasets: {registered}")
        if name in SHAPES_SPLITS:
            continue
        metadata = MetadataCatalog.get(name)
        json_file, image_root = metadata.get("json_file"), metadata.get("image_root")
        if json_file and not os.path.isfile(json_file):
            raise FileNotFoundError(f"dataset {name!r}: its annotation file {json_file} does not exist")
        if image_root and not os.path.isdir(image_root):
            raise FileNotFoundError(f"dataset {name!r}: its image folder {image_root} does not exist")
