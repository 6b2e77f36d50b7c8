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


def test_under_places_the_private_directory(tmp_path: Path) -> None:
    d = SharedDir(None, prefix="rollpatch-test-", under=tmp_path)
    assert d.own and d.path.parent == tmp_path
    d.close()
    assert list(tmp_path.iterdir()) == []


def test_sglang_channel_shared_memory_is_one_more_shared_dir() -> None:
    import threading

    from rollpatch.engines.sglang.channel import SglangChannel

    ch = SglangChannel("http://127.0.0.1:9", shared_dir=None, timeout=1.0, lock=threading.RLock())
    first, second = ch.shm("words"), ch.shm("words")
    assert first != second and first.parent == second.parent
    shm = Path("/dev/shm")
    if shm.is_dir():  # a private directory there, not the scratch one
        assert first.parent.parent == shm and first.parent != ch.shared_dir
    else:
        assert first.parent == ch.shared_dir
    first.write_bytes(b"mapped by both sides")
    ch.close()
    assert not first.parent.exists() and not ch.shared_dir.exists()
