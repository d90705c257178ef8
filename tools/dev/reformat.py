"""Formats the repository's Python with ruff, as `make test`'s `ruff format --check` wants it:

1. drops every ``# fmt: skip`` but those on hand-laid tables (``keeps_marker`` says which);
2. applies ruff's fixes that need no judgement: import order (I), pyupgrade (UP), the imports pyupgrade
   leaves unused (F401: ``Optional`` once ``X | None`` replaces it), stale ``noqa`` (RUF100);
3. runs ``ruff format``.

Run from any checkout, with no arguments, after a merge or a rewrite:

    python3 tools/dev/reformat.py

then ``ruff check`` lists what is left for a person (unused variables, bugbear's findings, long strings),
and ``git diff`` shows what changed (an import dropped as unused that another module imports from there
would fail the tests).
Only the files git tracks are touched. ruff is the pinned one of tools/setup_lint_env.sh unless --ruff
names another.
"""

import argparse
import ast
import io
import os
import re
import subprocess
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = "# fmt: skip"
# fixes that are the same whoever applies them
MECHANICAL_FIXES = "I,UP,F401,RUF100"
# a detectron2 config key, as in an override list: "MODEL.RESNETS.NORM"
CONFIG_KEY = re.compile(r"^[A-Z][A-Z0-9_]*(\.[A-Z0-9_]+)+$")
TABLE_BUILDERS = ("frozenset", "set", "tuple")


def is_literal_table(node: ast.expr) -> bool:
    """Whether ``node`` is made of constants only: literals in lists, tuples, sets and dicts, or one such
    passed to frozenset, set or tuple."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return is_literal_table(node.operand)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(is_literal_table(element) for element in node.elts)
    if isinstance(node, ast.Dict):
        return all(key is not None and is_literal_table(key) for key in node.keys) and all(
            is_literal_table(value) for value in node.values
        )
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in TABLE_BUILDERS:
        return len(node.args) == 1 and not node.keywords and is_literal_table(node.args[0])
    return False


def is_config_key(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(CONFIG_KEY.match(node.value))


def holds_override_list(statement: ast.stmt) -> bool:
    """Whether ``statement`` writes a detectron2 override list: KEY, value pairs (two or more), which read
    as pairs only when laid out by hand."""
    for node in ast.walk(statement):
        if isinstance(node, (ast.List, ast.Tuple)) and len(node.elts) >= 4 and len(node.elts) % 2 == 0:
            keys, values = node.elts[::2], node.elts[1::2]
            if all(map(is_config_key, keys)) and not any(map(is_config_key, values)):
                return True
    return False


def keeps_marker(statement: ast.stmt, module: ast.Module) -> bool:
    """The rule for a ``# fmt: skip`` that stays: its statement is a module-level table of constants (not
    ``__all__``), or writes a detectron2 override list (KEY, value pairs). Everything else is the
    formatter's."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.While, ast.If)):
        return False
    if statement in module.body and isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value:
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        names = {target.id for target in targets if isinstance(target, ast.Name)}
        if "__all__" not in names and is_literal_table(statement.value):
            return True
    return holds_override_list(statement)


def drop_markers(source: str) -> tuple[str, int, int]:
    """``source`` without the ``# fmt: skip`` markers that ``keeps_marker`` does not keep; returns it, and
    how many markers were dropped and kept."""
    module = ast.parse(source)
    statements = [node for node in ast.walk(module) if isinstance(node, ast.stmt)]
    marker_lines = [
        token.start
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and token.string.strip() == MARKER
    ]
    lines = source.splitlines(keepends=True)
    dropped = kept = 0
    for line, column in marker_lines:
        # the marker's statement: the innermost one ending on its line (a marker inside an expression has
        # none, and ruff ignores it)
        ending = [node for node in statements if node.end_lineno == line]
        statement = min(ending, key=lambda node: node.end_lineno - node.lineno, default=None)
        if statement is not None and keeps_marker(statement, module):
            kept += 1
            continue
        text = lines[line - 1]
        lines[line - 1] = text[:column].rstrip() + text[column + len(MARKER) :]
        dropped += 1
    return "".join(lines), dropped, kept


def tracked_python_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, check=True, capture_output=True, text=True)
    return [path for path in listed.stdout.split("\0") if path]


def pinned_ruff() -> str:
    setup = os.path.join(ROOT, "tools", "setup_lint_env.sh")
    return subprocess.run([setup], check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ruff", help="the ruff to run (default: the pinned one of tools/setup_lint_env.sh)")
    args = parser.parse_args(argv)
    ruff = args.ruff or pinned_ruff()
    files = tracked_python_files()
    dropped = kept = 0
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            source = f.read()
        if MARKER not in source:
            continue
        changed, file_dropped, file_kept = drop_markers(source)
        dropped, kept = dropped + file_dropped, kept + file_kept
        if changed != source:
            with open(os.path.join(ROOT, path), "w", encoding="utf-8") as f:
                f.write(changed)
    print(f"# fmt: skip markers: {dropped} dropped, {kept} kept", file=sys.stderr)
    subprocess.run([ruff, "check", "--fix-only", "--fixable", MECHANICAL_FIXES, *files], cwd=ROOT, check=True)
    subprocess.run([ruff, "format", *files], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
