"""Change notification of a directory store's key (``rollpatch.store.notify``, Linux inotify),
and the relay's watch of a ``file://`` board waking on it (docs/relay.md, "Long-poll").

No assertion is on wall time: the relay test sets ``watch_s`` to an hour, so a held long-poll
answered within the liveness bound can only have been woken by the notification."""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

import pytest

from rollpatch.store import open_store
from rollpatch.store.file import FileStore
from rollpatch.store.notify import KeyWatch
from tests.conftest import until
from tests.relayworld import KEY as KEY_LP
from tests.relayworld import World, client_of, held_in_thread, version_of, waiting

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify")

KEY = "runs/r/LATEST"


def _store(tmp: Path) -> FileStore:
    store = open_store(f"file://{tmp / 'board'}")
    assert isinstance(store, FileStore)
    return store


def test_a_watch_wakes_when_its_key_is_written_and_not_for_other_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.watch(KEY) is None  # the run's folder does not exist yet: poll
    store.put("runs/r/versions/000000000000.json", b"{}")
    store.cas(KEY, b"v0", expected=None)
    watch = store.watch(KEY)
    assert watch is not None
    try:
        assert not watch.wait(0.05)  # nothing written since
        store.put("runs/r/other", b"x")  # another file of the folder
        assert not watch.wait(0.05)
        t = threading.Timer(0.2, lambda: store.cas(KEY, b"v1", expected=b"v0"))
        t.start()
        assert watch.wait(60.0)  # woken by the rename into place, long before the timeout
        t.join()
        assert not watch.broken
    finally:
        watch.close()


def test_a_watch_whose_folder_goes_away_is_broken(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.cas(KEY, b"v0", expected=None)
    watch = KeyWatch.open(tmp_path / "board" / "runs" / "r" / "LATEST")
    assert watch is not None
    shutil.rmtree(tmp_path / "board" / "runs" / "r")
    assert watch.wait(60.0) and watch.broken
    assert watch.wait(0.0)  # stays broken: the caller reopens or polls
    watch.close()


def test_the_relay_learns_of_a_version_when_latest_is_written(tmp_path: Path) -> None:
    """watch_s is an hour: the held long-poll is answered with v1 only because the relay's
    watch woke when the publisher renamed LATEST into place."""
    w = World(tmp_path, watch_s=3600.0)
    try:
        c = client_of(w.origin.url)
        assert version_of(c.wait_newer(KEY_LP, -1, 30.0, c.held())) == 0
        t, out = held_in_thread(c, 0, 60.0)
        until(lambda: waiting(w.origin) == 1, "the long-poll to be held")
        w.publish()
        t.join(30)
        assert not t.is_alive() and version_of(out[0]) == 1
    finally:
        w.close()
