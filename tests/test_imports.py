"""Imports run one way between the package's rooms: its subpackages (layers, d2, ...), its top-level modules
(model_zoo) and its own ``__init__.py`` (``__init__``). The order of the rooms is written once, in the
docstring of ``sn_detection/__init__.py``, from the top down; every import statement of every module, at the
top or inside a function, ``import x`` or ``from x import y``, relative ones resolved, is read with ``ast``
(nothing is imported) and checked against it:

- an import from one room into another goes down the written order (rooms on one line import nothing of
  each other);
- no two rooms import each other;
- layers and data, at the ground, import no other room of the package.

``test_the_check_finds_what_it_must`` runs the checks on a small made-up package with such knots.
"""

import ast
import os
import re
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "sn_detection"
GROUND = ("layers", "data")
# the room of the package's own __init__.py
INIT_ROOM = "__init__"


@dataclass(frozen=True)
class Module:
    source: str
    is_package: bool  # an __init__.py: its relative imports start from itself
    path: str


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    line: int
    target: str  # the module imported, dotted: ``from x import y`` is x.y where that is a module, else x

    @property
    def rooms(self) -> tuple:
        return room_of(self.module), room_of(self.target)

    def __str__(self):
        return f"{self.module}:{self.line} imports {self.target} ({' -> '.join(self.rooms)})"


def read_package(folder: str, name: str = PACKAGE) -> dict:
    """Every module of the package in ``folder``, dotted name -> Module: its folders with an __init__.py."""
    modules = {}
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry.endswith(".py"):
            dotted = name if entry == "__init__.py" else f"{name}.{entry[: -len('.py')]}"
            with open(path, encoding="utf-8") as file:
                modules[dotted] = Module(file.read(), entry == "__init__.py", os.path.relpath(path, ROOT))
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            modules.update(read_package(path, f"{name}.{entry}"))
    return modules


def room_of(module: str) -> str:
    """``sn_detection.d2.config`` -> ``d2``, ``sn_detection.model_zoo`` -> ``model_zoo``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else INIT_ROOM


def _base(name: str, module: Module, node: ast.ImportFrom) -> str:
    """The module that ``from ... import`` names, relative levels resolved from ``name``."""
    if not node.level:
        return node.module
    package = name.split(".") if module.is_package else name.split(".")[:-1]
    if node.level > len(package):
        raise ValueError(f"{module.path}:{node.lineno}: a relative import above the package {PACKAGE}")
    parts = package[: len(package) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(modules: dict) -> list:
    """Every import statement of ``modules`` into the package, anywhere in a module."""
    found = []
    for name, module in modules.items():
        for node in ast.walk(ast.parse(module.source, module.path)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(name, module, node)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            else:
                continue
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    found.append(Import(name, node.lineno, target))
    return list(dict.fromkeys(found))  # one per statement and module: ``from x import a, b`` twice is x once


def written_order(init_source: str) -> list:
    """The rooms as the package's docstring writes them, top line first: a list of tuples of names (the
    docstring's one indented block, a line per level, the rooms of a level separated by commas)."""
    docstring = ast.get_docstring(ast.parse(init_source), clean=False) or ""
    block = re.search(r"\n\n((?: {4}\S.*\n)+)", docstring + "\n")
    assert block, "the package's docstring has no indented block of rooms"
    return [tuple(room.strip() for room in line.split(",")) for line in block.group(1).splitlines()]


def against_the_order(imports: list, order: list) -> list:
    """The imports from a room into a room on its own line or a line above it."""
    level = {room: len(order) - i for i, line in enumerate(order) for room in line}
    return [each for each in imports if each.rooms[0] != each.rooms[1] and level[each.rooms[1]] >= level[each.rooms[0]]]


def knots(imports: list) -> list:
    """The pairs of rooms that import each other, each with an import of either way."""
    first = {}
    for each in imports:
        if each.rooms[0] != each.rooms[1]:
            first.setdefault(each.rooms, each)
    return sorted(
        ((first[pair], first[pair[::-1]]) for pair in first if pair < pair[::-1] and pair[::-1] in first),
        key=lambda knot: knot[0].rooms,
    )


def from_the_ground(imports: list) -> list:
    """The imports from layers or data into any other room of the package."""
    return [each for each in imports if each.rooms[0] in GROUND and each.rooms[1] != each.rooms[0]]


MODULES = read_package(os.path.join(ROOT, PACKAGE))
IMPORTS = imports_of(MODULES)
ORDER = written_order(MODULES[PACKAGE].source)


def test_the_order_names_every_room_once_with_the_ground_at_the_bottom():
    written = [room for line in ORDER for room in line]
    assert len(written) == len(set(written)), f"a room written twice: {ORDER}"
    assert set(written) == {room_of(name) for name in MODULES}, "every room of the package, and only those"
    assert set(ORDER[-1]) == set(GROUND)


def test_the_imports_are_read():
    """What the checks below see of the package: its imports at the top, inside functions and relative."""
    read = {(each.module, each.target) for each in IMPORTS}
    assert ("sn_detection", "sn_detection.d2") in read  # from . import d2
    assert ("sn_detection.engine.launch", "sn_detection.d2") in read  # from ..d2 import ...
    assert ("sn_detection.model_zoo", "sn_detection.d2") in read  # inside get_config
    assert ("sn_detection.experiments.pretrain_grid.plan", "sn_detection.model_zoo") in read  # from ... import


def test_every_import_between_rooms_runs_down_the_written_order():
    wrong = against_the_order(IMPORTS, ORDER)
    assert not wrong, "imports up or sideways:\n" + "\n".join(map(str, wrong))


def test_no_two_rooms_import_each_other():
    found = knots(IMPORTS)
    assert not found, "rooms that import each other:\n" + "\n".join(f"{a}\n  and {b}" for a, b in found)


def test_layers_and_data_import_nothing_of_the_package():
    wrong = from_the_ground(IMPORTS)
    assert not wrong, "imports out of the ground:\n" + "\n".join(map(str, wrong))


def test_the_check_finds_what_it_must():
    """A made-up package with an import up from inside a function, one sideways, two knots, and the ground
    reaching up: each check finds its own and nothing else, and the package untied passes them all."""
    package = {
        "sn_detection": (True, '"""Rooms:\n\n    engine\n    __init__\n    d2, analysis\n    layers, data\n"""\n'),
        "sn_detection.layers": (True, "import torch\nfrom .base import Base\n"),
        "sn_detection.layers.base": (False, "def f():\n    from ..d2.config import KEYS\n"),
        "sn_detection.data": (True, ""),
        "sn_detection.analysis": (True, "from sn_detection import layers\n"),
        "sn_detection.d2": (True, "from . import config\nfrom ..layers import Base\n"),
        "sn_detection.d2.config": (False, "def keys():\n    from sn_detection.engine.launch import load\n"),
        "sn_detection.d2.hook": (False, "import sn_detection.analysis\n"),
        "sn_detection.engine": (True, "from .. import __version__\n"),
        "sn_detection.engine.launch": (False, "from ..d2 import config\nfrom ..data import *\n"),
    }
    modules = {name: Module(source, is_package, name) for name, (is_package, source) in package.items()}
    imports = imports_of(modules)
    order = written_order(modules["sn_detection"].source)
    assert order == [("engine",), ("__init__",), ("d2", "analysis"), ("layers", "data")]
    assert {(each.module, each.target) for each in imports} == {
        ("sn_detection.layers", "sn_detection.layers.base"),
        ("sn_detection.layers.base", "sn_detection.d2.config"),
        ("sn_detection.analysis", "sn_detection.layers"),
        ("sn_detection.d2", "sn_detection.d2.config"),
        ("sn_detection.d2", "sn_detection.layers"),
        ("sn_detection.d2.config", "sn_detection.engine.launch"),
        ("sn_detection.d2.hook", "sn_detection.analysis"),
        ("sn_detection.engine", "sn_detection"),
        ("sn_detection.engine.launch", "sn_detection.d2.config"),
        ("sn_detection.engine.launch", "sn_detection.data"),
    }
    assert {(each.module, each.target) for each in against_the_order(imports, order)} == {
        ("sn_detection.layers.base", "sn_detection.d2.config"),  # up, from inside a function
        ("sn_detection.d2.config", "sn_detection.engine.launch"),  # up, from inside a function
        ("sn_detection.d2.hook", "sn_detection.analysis"),  # sideways
    }
    assert [{a.module, b.module} for a, b in knots(imports)] == [
        {"sn_detection.d2.config", "sn_detection.engine.launch"},
        {"sn_detection.d2", "sn_detection.layers.base"},
    ]
    assert [(each.module, each.target) for each in from_the_ground(imports)] == [
        ("sn_detection.layers.base", "sn_detection.d2.config")
    ]
    untied = {
        **modules,
        "sn_detection.layers.base": Module("", False, "base"),
        "sn_detection.d2.config": Module("def keys():\n    from sn_detection.layers import load\n", False, "config"),
        "sn_detection.d2.hook": Module("", False, "hook"),
    }
    imports = imports_of(untied)
    assert not against_the_order(imports, order) and not knots(imports) and not from_the_ground(imports)
    above = {**untied, "sn_detection.d2.hook": Module("from ... import layers\n", False, "hook")}
    with pytest.raises(ValueError, match="hook:1: a relative import above the package"):
        imports_of(above)
