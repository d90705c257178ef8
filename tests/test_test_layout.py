"""The test files' basenames are unique: pytest imports a test file of a folder without ``__init__.py`` by
its basename, so two files of one name collide when one worker collects both (an "import file mismatch"),
and whether they meet depends on how the files are shared among the workers."""

import collections
import os

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_every_test_file_has_a_basename_of_its_own():
    found = collections.defaultdict(list)
    for folder, _, names in os.walk(TESTS):
        for name in names:
            if name.startswith("test_") and name.endswith(".py"):
                found[name].append(os.path.relpath(os.path.join(folder, name), TESTS))
    assert not {name: paths for name, paths in found.items() if len(paths) > 1}
