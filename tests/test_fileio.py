"""vrl.fileio.atomic_path: the one way the SDK writes a file or folder that a crash must not leave half-written."""

from __future__ import annotations

import pytest

from vrl.fileio import TMP_SUFFIX, atomic_path, write_text


def test_a_file_appears_whole_and_replaces_the_old_one(tmp_path):
    path = tmp_path / "state.json"
    write_text(path, "old")
    with atomic_path(path) as tmp:
        assert tmp.name == "state.json" + TMP_SUFFIX
        tmp.write_text("new")
        assert path.read_text() == "old"  # untouched until the block succeeds
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_folder_replaces_the_folder_of_that_name(tmp_path):
    target = tmp_path / "iter-000002"
    target.mkdir()
    (target / "stale").write_text("x")
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "state.pt").write_bytes(b"\0")
    assert sorted(p.name for p in target.iterdir()) == ["state.pt"]
    assert [p.name for p in tmp_path.iterdir()] == ["iter-000002"]


def test_a_failed_write_leaves_the_target_and_no_temporary(tmp_path):
    path = tmp_path / "history.json"
    write_text(path, "kept")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert path.read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["history.json"]


def test_a_temporary_left_by_a_crash_is_cleared_first(tmp_path):
    (tmp_path / ("ckpt" + TMP_SUFFIX)).mkdir()
    (tmp_path / ("ckpt" + TMP_SUFFIX) / "partial").write_text("x")
    with atomic_path(tmp_path / "ckpt") as tmp:
        tmp.mkdir()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == []
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
