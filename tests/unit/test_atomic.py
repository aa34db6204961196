"""State files are replaced whole or not at all (issue #15 item 12)."""

import pytest

from pipeline.atomic import write_atomic, write_text_atomic


def test_a_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path):
    target = tmp_path / "study.yaml"
    write_text_atomic(target, "old: 1\n")

    def half_then_crash(tmp):
        tmp.write_text("new: ")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(target, half_then_crash)
    assert target.read_text() == "old: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["study.yaml"]


def test_a_write_replaces_the_file(tmp_path):
    target = tmp_path / "sub" / "promoted.yaml"
    write_text_atomic(target, "a")
    write_text_atomic(target, "b")
    assert target.read_text() == "b"
