"""rollpatch.engines.shared_dir: the one owner of the files an adapter shares with its server."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpatch.engines.shared_dir import SharedDir


def test_files_are_removed_on_every_way_out(tmp_path: Path) -> None:
    d = SharedDir(tmp_path, prefix="unused-")
    with d.files("blob", 3) as paths:
        assert len(set(paths)) == 3 and all(p.parent == tmp_path for p in paths)
        assert all(p.name.startswith("blob-") and p.suffix == ".bin" for p in paths)
        for p in paths[:2]:  # one never made: its removal must not fail
            p.write_bytes(b"x")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError), d.files("stage") as (path,):
        path.write_text("{}")
        raise RuntimeError("the call failed")
    assert list(tmp_path.iterdir()) == []


def test_close_removes_only_its_own_directory(tmp_path: Path) -> None:
    mine = SharedDir(None, prefix="rollpatch-test-")
    assert mine.own and mine.path.is_dir() and mine.path.name.startswith("rollpatch-test-")
    mine.name("x").write_bytes(b"left behind")
    mine.close()
    assert not mine.path.exists()
    theirs = SharedDir(tmp_path, prefix="unused-")
    theirs.close()
    assert not theirs.own and tmp_path.is_dir()
