"""tools/gpu_checks.sh says in its header, for every step it runs, what the step checks and how long it may
take: the time limits of its commands, as the script sets them, and their sum. A limit changed in the script
and not in the header fails here."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "gpu_checks.sh")


def duration(seconds: int) -> str:
    minutes, seconds = divmod(seconds, 60)
    return " ".join(part for part in (f"{minutes} min" if minutes else "", f"{seconds} s" if seconds else "") if part)


def read_script() -> tuple[list[str], dict[str, list[int]], dict[str, tuple[str, list[int], str]]]:
    """(the steps the script accepts, each step's command time limits, each step's header entry: its stated
    total, its stated limits and its description)."""
    with open(SCRIPT, encoding="utf-8") as f:
        text = f.read()
    (accepted,) = re.findall(r"^\s*case \$name in ([\w|]+)\)", text, flags=re.MULTILINE)
    limits = {
        name: [int(seconds) for seconds in re.findall(r'^\s*step (?:"[^"]+"|\S+) (\d+) ', body, flags=re.MULTILINE)]
        for name, body in re.findall(r"^if wanted (\w+); then\n(.*?)^fi$", text, flags=re.MULTILINE | re.DOTALL)
    }
    header = text.split("\nset -uo pipefail", 1)[0]
    entries = {}
    for name, total, stated, description in re.findall(
        r"^#   (\w+) +\(at most ([^:]+): ([\d +]+) s\) (.*?)(?=^#   \w+ +\(|^#\n)",
        header,
        flags=re.MULTILINE | re.DOTALL,
    ):
        entries[name] = (total, [int(seconds) for seconds in stated.split("+")], " ".join(description.split()))
    return accepted.split("|"), limits, entries


def test_the_header_states_every_steps_limits_as_the_script_sets_them():
    accepted, limits, entries = read_script()
    assert accepted == list(limits) == list(entries) == ["tests", "counts", "norms", "train", "inference", "pretrain"]
    for name in accepted:
        total, stated, description = entries[name]
        assert stated == limits[name], (name, stated, limits[name])
        assert total == duration(sum(limits[name])), (name, total)
        assert len(description) > 80, (name, description)  # what it checks


def test_durations_read_as_the_header_writes_them():
    assert [duration(s) for s in (90, 150, 300, 330, 61)] == [
        "1 min 30 s",
        "2 min 30 s",
        "5 min",
        "5 min 30 s",
        "1 min 1 s",
    ]
