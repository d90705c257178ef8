"""The command-line types the tools share: a count of at least 1, and a file written after the work,
checked before it."""

import argparse

import pytest

from sn_detection.engine.arguments import create_folder_of, output_file, positive_int


def test_a_count_of_at_least_one_is_kept():
    assert positive_int("1") == 1 and positive_int("12") == 12


@pytest.mark.parametrize("value, shown", [("0", "0"), ("-3", "-3"), ("2.5", "'2.5'"), ("x", "'x'")])
def test_a_count_below_one_or_not_an_int_is_an_error_naming_it(value, shown):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{shown} is invalid: it must be an int >= 1$"):
        positive_int(value)


def test_a_file_written_after_the_work_is_checked_before_it(tmp_path):
    """--json and --publish are written when hours of timing or training are done: a path that cannot be
    written fails at once, naming the problem; missing folders are fine, made when the file is written."""
    absent = tmp_path / "absent" / "deeper" / "rows.json"
    assert output_file(str(absent)) == str(absent)
    assert not (tmp_path / "absent").exists()  # checked by the parser, made by the writer
    create_folder_of(str(absent))
    assert absent.parent.is_dir()
    (tmp_path / "notes.txt").write_text("")
    under_a_file = str(tmp_path / "notes.txt" / "rows.json")
    with pytest.raises(argparse.ArgumentTypeError, match=f"{tmp_path / 'notes.txt'} is a file, not a folder"):
        output_file(under_a_file)
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder; give the file to write"):
        output_file(str(tmp_path))
