"""The worked example of docs/adding_a_normalizer.md runs as written: its layer matches the equation and
passes its own tests, so the page cannot drift from the base classes it teaches."""

import os
import re

import pytest

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "adding_a_normalizer.md")


def python_blocks(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.MULTILINE | re.DOTALL)


@pytest.mark.usefixtures("one_thread")
def test_adding_a_normalizer_runs_as_written():
    blocks = python_blocks(DOC)
    assert len(blocks) == 2  # the module, then its tests (which the second block calls)
    namespace = {"__name__": "adding_a_normalizer"}
    for block in blocks:
        exec(compile(block, DOC, "exec"), namespace)
    layer = namespace["InstanceNorm2d"](8)
    assert layer.norm_identity() == "InstanceNorm2d(eps=1e-05)"
    with pytest.raises(ValueError, match="eps=-1 is invalid"):
        namespace["InstanceNorm2d"](8, eps=-1)
