"""The docs hold: the worked example of docs/adding_a_normalizer.md runs as written (its layer matches the
equation and passes its own tests, so the page cannot drift from the base classes it teaches), and every
relative link and anchor of the README and the docs leads somewhere."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "adding_a_normalizer.md")


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


PAGES = ["README.md", "CHANGELOG.md", "model_zoo/README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    path = os.path.join(ROOT, page)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img src="([^"]+)"', text)
    broken = []
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(linked):
            broken.append(target)
        elif anchor and linked.endswith(".md"):
            with open(linked, encoding="utf-8") as f:
                headings = re.findall(r"^#+ (.+)$", f.read(), flags=re.MULTILINE)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page}: links that lead nowhere: {broken}"
