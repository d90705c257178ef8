"""docs/glossary.md defines the terms of the layers' GPU path, and every page that uses one before it
defines it links its first use to the glossary.

``TERMS`` lists them with the forms the pages write. On each page of the docs (README.md, docs/*.md,
model_zoo/README.md, configs/README.md), the first use of a term in the prose (outside code and link
targets) must be the text of a link to the term's glossary entry, unless a heading of the page that names
the term comes first (the page's own definition)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOSSARY = os.path.join("docs", "glossary.md")
PAGES = ["README.md", "model_zoo/README.md", "configs/README.md"] + sorted(
    os.path.join("docs", name)
    for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md") and name != "glossary.md"
)
# the glossary's heading of each term -> the forms the docs write it in (a regular expression, any case)
TERMS = {
    "Fused path": r"fused path",
    "Kernel path": r"kernel path",
    "Host work": r"host(?:'s)? work|host time",
    "Call plan": r"call plans?",
    "Statistics blocks": r"statistics blocks?",
    "Specialization": r"speciali[sz]ations?",
    "Direct launch": r"direct launch(?:es)?",
    "Multi-op SN": r"multi-op SN|SN multi-op",
}
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", flags=re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def blanked(pattern: re.Pattern, text: str, keep: int = 0) -> str:
    """``text`` with every match of ``pattern`` blanked after its first ``keep`` characters, line breaks
    kept, so that positions hold."""
    return pattern.sub(lambda m: m.group(0)[:keep] + re.sub(r"[^\n]", " ", m.group(0)[keep:]), text)


def first_uses_without_a_link(text: str, terms: dict[str, str] = TERMS) -> list[str]:
    """The terms whose first use in the markdown ``text`` neither follows a heading of ``text`` that names
    the term nor is the text of a link to its entry in glossary.md, each with its line."""
    prose = blanked(re.compile(r"`[^`\n]*`"), blanked(FENCE, text))
    links = [(m.start(1), m.end(1), m.group(2)) for m in LINK.finditer(prose)]
    prose = blanked(re.compile(r"\]\([^)]*\)"), prose, keep=1)  # link targets are no prose
    found = []
    for term, forms in terms.items():
        use = re.search(forms, prose, flags=re.IGNORECASE)
        if use is None:
            continue
        heading = re.search(rf"^#+ .*(?:{forms})", prose, flags=re.IGNORECASE | re.MULTILINE)
        if heading and heading.start() <= use.start():
            continue
        target = f"glossary.md#{anchor(term)}"
        if any(start <= use.start() < end and link.endswith(target) for start, end, link in links):
            continue
        found.append(f"{term!r} at line {prose.count(chr(10), 0, use.start()) + 1}: {use.group(0)!r}")
    return found


def test_the_glossary_defines_every_term():
    with open(os.path.join(ROOT, GLOSSARY), encoding="utf-8") as f:
        headings = re.findall(r"^### (.+)$", f.read(), flags=re.MULTILINE)
    assert not [term for term in TERMS if term not in headings]


@pytest.mark.parametrize("page", PAGES)
def test_a_page_links_a_term_it_uses_before_defining_it(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        missing = first_uses_without_a_link(f.read())
    assert not missing, f"{page}: first uses that do not link to {GLOSSARY}: {missing}"


def test_what_counts_as_a_linked_or_defined_first_use():
    terms = {"Call plan": r"call plans?"}
    linked = "A [call plan](glossary.md#call-plan) is kept; call plans are cleared."
    assert first_uses_without_a_link(linked, terms) == []
    assert first_uses_without_a_link("Its call plans, [call plan](glossary.md#call-plan).", terms) == [
        "'Call plan' at line 1: 'call plans'"
    ]
    assert first_uses_without_a_link("## Call plans\n\nA call plan is ...", terms) == []
    assert first_uses_without_a_link("`call_plan` and\n```\ncall plan\n```\n", terms) == []  # code is no use
    assert first_uses_without_a_link("A [call plan](benchmarks.md#call-plan).", terms) == [
        "'Call plan' at line 1: 'call plan'"
    ]
