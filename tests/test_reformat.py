"""tools/dev/reformat.py keeps ``# fmt: skip`` only on hand-laid tables, and the tree holds no other: a
marker anywhere else is one the formatter should have had (``make test``'s ``ruff format --check`` cannot
tell, since ruff honours every marker)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("reformat", os.path.join(ROOT, "tools", "dev", "reformat.py"))
reformat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reformat)

SOURCE = """\
TABLE = {
    ("BN", "BN"): 19.3, ("GN", "GN"): 32.7,
}  # fmt: skip
__all__ = [
    "a", "b",
]  # fmt: skip


def overrides(n):
    return [
        "SOLVER.MAX_ITER", str(n), "SOLVER.STEPS", "()",
    ]  # fmt: skip


def call(n):
    print("a",
          n)  # fmt: skip
    return ["MODEL.A", "MODEL.B", "MODEL.C", "MODEL.D"]  # fmt: skip
"""


def test_markers_stay_on_tables_and_override_lists_only():
    changed, dropped, kept = reformat.drop_markers(SOURCE)
    assert (dropped, kept) == (3, 2)
    lines = changed.splitlines()
    assert lines[2] == "}  # fmt: skip"  # a module-level table of constants
    assert lines[5] == "]"  # __all__ is the formatter's
    assert lines[11] == "    ]  # fmt: skip"  # KEY, value pairs
    assert lines[16] == "          n)"  # a call
    assert lines[17] == '    return ["MODEL.A", "MODEL.B", "MODEL.C", "MODEL.D"]'  # keys only: not pairs


def test_the_tree_has_no_marker_the_rule_would_drop():
    stray = []
    for path in reformat.tracked_python_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            source = f.read()
        if reformat.MARKER in source:
            stray += [path] * reformat.drop_markers(source)[1]
    assert not stray, f"# fmt: skip outside a hand-laid table (run tools/dev/reformat.py): {sorted(set(stray))}"
