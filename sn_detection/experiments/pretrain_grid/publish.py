"""``--publish FILE``: the grid's markdown at FILE, a section of model_zoo/README.md, and beside it its settings
files (``published_settings``), so that the grid's choice is part of the repository and a finetune sweep on a
machine whose cache and output folder are empty pretrains the same backbones."""

from __future__ import annotations

import os

from ...engine.arguments import create_folder_of
from ..jobs import write_json

BEST_FILE, EQUAL_FILE = "best.json", "equal_top1.json"


def published_settings(publish: str) -> dict[str, str]:
    """The settings files written beside a published table ``publish`` (``--publish``): {output file name
    (BEST_FILE, EQUAL_FILE): its published path}, ``publish`` with ``.best.json`` or ``.equal_top1.json``
    for its extension."""
    stem = os.path.splitext(publish)[0]
    return {name: f"{stem}.{name}" for name in (BEST_FILE, EQUAL_FILE)}


def publish_outputs(publish: str, text: str, settings: dict[str, dict]) -> None:
    """The markdown ``text`` at ``publish`` and each of ``settings`` ({output file name: its content}) at its
    ``published_settings`` path, their folder made where missing."""
    create_folder_of(publish)
    for name, overrides in settings.items():
        write_json(published_settings(publish)[name], overrides)
    with open(publish, "w") as f:
        f.write(text)
