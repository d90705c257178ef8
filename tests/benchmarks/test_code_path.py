"""``code_path``: the calls of a package's functions recorded in order, and the files, stretches and hops read
from them."""

import sys

from sn_detection.benchmarks.code_path import CodePath, Direction, recorded_calls


def test_calls_into_a_package_are_recorded_in_order_with_their_files(tmp_path, monkeypatch):
    package = tmp_path / "package"
    package.mkdir()
    (package / "outer.py").write_text(
        "import inner\n\ndef run():\n    helper()\n    inner.work()\n    return [i for i in range(2)]\n\n"
        "def helper():\n    pass\n"
    )
    (package / "inner.py").write_text("def work():\n    return sum(i for i in range(3))\n")
    monkeypatch.syspath_prepend(str(package))
    import outer

    calls = recorded_calls(outer.run, str(package))
    # the comprehension and the generator expression are calls of their own (Python 3.11: the first one too);
    # the generator's resumptions are not
    expected = [("outer.py", "run"), ("outer.py", "helper"), ("inner.py", "work"), ("inner.py", "<genexpr>")]
    assert list(calls.calls[:4]) == expected
    assert calls.calls[4:] in ((("outer.py", "<listcomp>"),), ())
    assert calls.files == ("outer.py", "inner.py")
    assert calls.stretches == (
        ("outer.py", "inner.py", "outer.py") if sys.version_info < (3, 12) else ("outer.py", "inner.py")
    )
    assert sys.getprofile() is None


def test_hops_and_files_entered_again():
    direction = Direction((("a.py", "f"), ("a.py", "g"), ("b.py", "h"), ("a.py", "k"), ("c.py", "m"), ("c.py", "n")))
    assert direction.files == ("a.py", "b.py", "c.py")
    assert direction.stretches == ("a.py", "b.py", "a.py", "c.py")
    assert direction.hops == 3 and direction.reentered == ("a.py",)
    once = Direction((("a.py", "f"), ("b.py", "g")))
    assert once.hops == 1 and once.reentered == ()
    step = CodePath(direction, once)
    assert step.files == ("a.py", "b.py", "c.py") and step.hops == 4
    assert Direction(()).hops == 0
