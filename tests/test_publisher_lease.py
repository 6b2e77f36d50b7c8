"""One publisher per run: the run's publisher lease (publisher/lease.py, docs/publisher.md).
The refusal of a second publisher and a takeover are in test_publisher_errors.py; helpers in
tests/pubfix.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rollpatch.board import Board
from rollpatch.errors import ConfigError, ConflictError, TransientStoreError
from rollpatch.layout import publisher_lease_key
from rollpatch.liveness import process_token
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.publisher import lease as lease_mod
from rollpatch.store import MemoryStore
from tests.pubfix import (
    RUN,
    OutageStore,
    board,
    copy_masters,
    into_outage,
    nudge,
    random_masters,
)

_FIXTURES = (board,)  # used by name
KEY = publisher_lease_key(RUN)


def _held(board: Board) -> dict[str, object]:
    doc: dict[str, object] = json.loads(board.store.get(KEY))
    return doc


def _plant(board: Board, publisher: str, token: str, *, expires_in: float) -> None:
    now = time.time()
    holder = lease_mod.Holder(publisher, token, now, now + expires_in)
    board.store.cas(KEY, holder.encode(), expected=None)


def test_a_lease_held_elsewhere_refuses_until_it_runs_out(
    board: Board, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A token from another host (no /proc part: nothing can be told from it) holds the run
    until its expiry, by that host's clock."""
    _plant(board, "other-host:77", "0123456789abcdef", expires_in=lease_mod.LEASE_S)
    with pytest.raises(ConfigError, match="being published by 'other-host:77'"):
        Publisher(board, RUN)
    later = time.time() + lease_mod.LEASE_S + 5
    monkeypatch.setattr(lease_mod, "_clock", lambda: later)
    with caplog.at_level(logging.WARNING, logger="rollpatch.publisher"):
        pub = Publisher(board, RUN, PublisherConfig(publisher_id="me"))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "publisher 'other-host:77''s lease ran out" in said, said
    assert _held(board)["publisher"] == "me"
    pub.close()
    assert _held(board)["released"] is True


def test_a_killed_publisher_on_this_host_frees_the_run_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kill -9 of a publisher: its lease would hold for LEASE_S, but /proc shows its process
    is gone, so a publisher started at once on the same host takes the run."""
    uri = f"file://{tmp_path / 'board'}"
    code = (
        "import sys, time\n"
        "from rollpatch.publisher import Publisher, PublisherConfig\n"
        "import numpy as np\n"
        f"pub = Publisher({uri!r}, {RUN!r}, PublisherConfig(publisher_id='doomed'))\n"
        "pub.publish({'w': np.ones((8, 8), np.float32)})\n"
        "pub.flush()\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError, match="being published by 'doomed'"):
            Publisher(uri, RUN)  # alive: refused
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rollpatch.publisher"):
            pub = Publisher(uri, RUN, PublisherConfig(publisher_id="next"))
        assert time.monotonic() - t0 < 5  # not the lease's 60 s
        assert pub.last_durable == 0
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "publisher 'doomed' no longer runs" in said, said
        pub.close()
    finally:
        child.kill()
        child.wait()


def test_an_unreadable_lease_is_replaced(board: Board, caplog: pytest.LogCaptureFixture) -> None:
    board.store.cas(KEY, b"\x00not a lease", expected=None)
    with caplog.at_level(logging.WARNING, logger="rollpatch.publisher"):
        Publisher(board, RUN).close()
    assert any("not one (unreadable)" in r.getMessage() for r in caplog.records)


def test_the_lease_is_renewed_while_the_publisher_idles(
    board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_mod, "RENEW_S", 0.05)
    with Publisher(board, RUN):
        first = _held(board)["renewed"]
        time.sleep(0.5)
        assert _held(board)["renewed"] != first
        assert _held(board)["token"] == _held(board)["token"]


def test_an_async_publisher_taken_over_stops_before_its_next_manifest(board: Board) -> None:
    masters = random_masters(seed=81)
    first = Publisher(board, RUN, PublisherConfig(publisher_id="a"))
    first.publish(copy_masters(masters))
    first.flush(timeout=30)
    second = Publisher(board, RUN, PublisherConfig(publisher_id="b", takeover=True))
    nudge(masters, seed=82)
    first.publish(copy_masters(masters))
    with pytest.raises(ConflictError, match="taken over by publisher 'b'"):
        first.flush(timeout=30)
    assert board.versions(RUN) == [0]
    nudge(masters, seed=83)
    assert second.publish(copy_masters(masters)) == 1
    second.flush(timeout=30)
    first.close()  # the error was reported by flush()
    second.close()
    assert board.versions(RUN) == [0, 1] and board.manifest(RUN, 1).publisher == "b"


def test_a_publisher_taken_over_during_a_store_outage_stops_when_the_store_answers() -> None:
    store = OutageStore(f"lease-{uuid.uuid4().hex[:12]}")
    board = Board(store)
    masters = random_masters(seed=84)
    first = Publisher(board, RUN, PublisherConfig(publisher_id="a", outage_s=60))
    first.publish(copy_masters(masters))
    first.flush(timeout=30)
    store.down.set()
    nudge(masters, seed=85)
    first.publish(copy_masters(masters))
    t0 = time.monotonic()
    while first.stats.outage_since_s is None:
        assert time.monotonic() - t0 < 20
        time.sleep(0.01)
    # meanwhile another publisher took the run (its lease had run out, say)
    holder = lease_mod.Holder("b", process_token(), time.time(), time.time() + 60)
    MemoryStore._store(store, KEY, holder.encode())  # beside the outage
    store.down.clear()
    with pytest.raises(ConflictError, match="taken over by publisher 'b'"):
        first.flush(timeout=60)
    first.close()
    assert board.versions(RUN) == [0]


def test_cli_publishes_one_after_another_and_is_refused_beside_a_live_publisher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollpatch.cli import main
    from tests.conftest import masters, save_masters

    uri = f"file://{tmp_path / 'board'}"
    ckpt = tmp_path / "m.safetensors"
    save_masters(ckpt, masters(1))
    publish = ["publish", str(ckpt), "--board", uri, "--run", RUN]
    assert main(publish) == 0
    save_masters(ckpt, masters(1, step=1e-3))
    assert main(publish) == 0  # the first let go when it exited
    capsys.readouterr()
    with Publisher(uri, RUN, PublisherConfig(publisher_id="trainer")):
        assert main(publish) == 2
        err = capsys.readouterr().err
        assert "being published by 'trainer'" in err and "--takeover" in err
    assert Board(uri).versions(RUN) == [0, 1]


def test_a_failed_publisher_lets_go_of_the_run_without_close() -> None:
    """The soak's trainer drops a publisher that failed and starts another, without close():
    a failed publisher never writes again, so it releases the run at once."""
    store, board, first, masters = into_outage(86, PublisherConfig(outage_s=0), asynchronous=False)
    with pytest.raises(TransientStoreError):
        first.publish(copy_masters(masters))
    store.down.clear()
    second = Publisher(board, RUN, asynchronous=False)  # the first is neither closed nor gone
    assert second.publish(copy_masters(masters)) == 1
    second.close()
