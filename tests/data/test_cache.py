import os

import pytest

from sn_detection.data.cache import MANIFEST, ensure_folder, is_intact

KEY = {"name": "toy", "version": 1}


class CountingGenerator:
    def __init__(self):
        self.calls = 0

    def __call__(self, folder):
        self.calls += 1
        os.makedirs(os.path.join(folder, "sub"))
        for name, text in (("a.txt", "alpha"), ("sub/b.txt", "beta")):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)


@pytest.fixture
def built(tmp_path):
    generate = CountingGenerator()
    folder = ensure_folder(str(tmp_path / "toy"), KEY, generate)
    return folder, generate


def test_generates_once_then_reuses(built):
    folder, generate = built
    assert is_intact(folder, KEY)
    ensure_folder(folder, KEY, generate)
    assert generate.calls == 1
    assert sorted(os.listdir(os.path.dirname(folder))) == ["toy"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda folder: open(os.path.join(folder, "sub", "b.txt"), "w").close(),  # truncated
        lambda folder: os.remove(os.path.join(folder, "a.txt")),  # missing
        lambda folder: open(os.path.join(folder, "stray.tmp"), "w").close(),  # half-written extra
        lambda folder: os.remove(os.path.join(folder, MANIFEST)),  # killed before the manifest
        lambda folder: open(os.path.join(folder, MANIFEST), "w").write("{"),  # corrupt manifest
    ],
)
def test_damaged_folder_is_regenerated(built, damage):
    folder, generate = built
    damage(folder)
    assert not is_intact(folder, KEY)
    ensure_folder(folder, KEY, generate)
    assert generate.calls == 2
    assert is_intact(folder, KEY)
    with open(os.path.join(folder, "sub", "b.txt")) as f:
        assert f.read() == "beta"


def test_other_arguments_regenerate(built):
    folder, generate = built
    other = {**KEY, "version": 2}
    assert not is_intact(folder, other)
    ensure_folder(folder, other, generate)
    assert generate.calls == 2 and is_intact(folder, other)


def test_failed_generation_leaves_nothing(tmp_path):
    def broken(folder):
        open(os.path.join(folder, "partial"), "w").close()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ensure_folder(str(tmp_path / "toy"), KEY, broken)
    assert os.listdir(tmp_path) == []


_KILLED_WRITER = """
import sys, time
from sn_detection.data.cache import ensure_folder

def generate(folder):
    open(folder + "/a.txt", "w").close()
    print("writing", flush=True)
    time.sleep(600)

ensure_folder(sys.argv[1], {"name": "toy", "version": 1}, generate)
"""


def test_temporary_folder_of_a_killed_writer_is_removed_by_the_next(tmp_path):
    import signal
    import subprocess
    import sys

    folder = str(tmp_path / "toy")
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, folder], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signal.SIGKILL)  # no chance to clean up
    writer.wait()
    (abandoned,) = os.listdir(tmp_path)
    assert abandoned.startswith(f".toy.{writer.pid}.")
    live = tmp_path / f".toy.{os.getpid()}.another-writer"  # a writer that still runs: left alone
    live.mkdir()

    generate = CountingGenerator()
    ensure_folder(folder, KEY, generate)
    assert generate.calls == 1 and is_intact(folder, KEY)
    assert sorted(os.listdir(tmp_path)) == [live.name, "toy"]
