"""A store outage does not stop the publisher (``PublisherConfig.outage_s``,
publisher/outage.py): it keeps the version, retries, and resumes from the board's LATEST once
the store answers. Before session 41 the first failure stopped it for good (audit F, session
40: a trainer had to build a new Publisher itself). Helpers: tests/pubfix.py."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.errors import TransientStoreError
from rollpatch.publisher import Publisher, PublisherConfig
from tests.pubfix import (
    RUN,
    OutageStore,
    check_all,
    copy_masters,
    into_outage,
    nudge,
    random_masters,
)


def _store(only: object = None) -> OutageStore:
    return OutageStore(f"outage-{uuid.uuid4().hex[:12]}", only=only)  # type: ignore[arg-type]


def _wait_failures(store: OutageStore, n: int = 1, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while store.failures < n:
        assert time.monotonic() - t0 < timeout, "the publisher never tried the store"
        time.sleep(0.01)


def test_an_async_publisher_rides_out_an_outage_and_publishes_the_newest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _store()
    board = Board(store)
    masters = random_masters(seed=11)
    expected: dict[int, dict[str, np.ndarray]] = {}
    with caplog.at_level(logging.WARNING, logger="rollpatch.publisher"):
        pub = Publisher(board, RUN, PublisherConfig(outage_s=60))
        expected[pub.publish(copy_masters(masters))] = copy_masters(masters)
        pub.flush(timeout=30)
        store.down.set()
        for i in range(4):  # the first fails in the store; the others wait and coalesce
            nudge(masters, seed=20 + i)
            expected[pub.publish(copy_masters(masters))] = copy_masters(masters)
            if i == 0:
                _wait_failures(store)
        assert pub.stats.outage_since_s is not None
        time.sleep(0.6)  # at least one retry meets the outage again
        store.down.clear()
        pub.flush(timeout=60)  # no error: the outage was ridden out
        newest = pub.publish(copy_masters(masters))
        expected[newest] = copy_masters(masters)
        pub.close()
    latest = board.latest(RUN)
    assert latest is not None and latest.version == newest
    assert 4 in board.versions(RUN)  # the newest snapshot taken during the outage
    check_all(board, expected)
    assert pub.stats.outages == 1 and pub.stats.outage_since_s is None
    said = {getattr(r, "rp_event", None): getattr(r, "rp_fields", {}) for r in caplog.records}
    assert "injected outage" in said["store_unreachable"]["error"], said  # structured events
    assert said["store_unreachable"]["run"] == RUN and said["store_back"]["resumed_from"] >= 0


def test_a_manifest_written_before_latest_failed_is_rolled_forward_not_published_twice() -> None:
    """The outage begins between the manifest and LATEST: the resume finds the manifest,
    rolls LATEST forward to it, and the snapshot it came from is not published again."""
    store = _store(only=lambda key: key.endswith("LATEST"))
    board = Board(store)
    masters = random_masters(seed=12)
    expected = {}
    pub = Publisher(board, RUN, PublisherConfig(outage_s=60), asynchronous=False)
    expected[pub.publish(copy_masters(masters))] = copy_masters(masters)
    nudge(masters, seed=30)
    store.down.set()
    timer = threading.Timer(1.0, store.down.clear)
    timer.start()
    try:
        v = pub.publish(copy_masters(masters))  # synchronous: returns once it is durable
    finally:
        timer.cancel()
    expected[v] = copy_masters(masters)
    assert store.failures >= 1
    latest = board.latest(RUN)
    assert latest is not None and latest.version == v == pub.last_durable == 1
    nudge(masters, seed=31)
    expected[pub.publish(copy_masters(masters))] = copy_masters(masters)
    pub.close()
    assert board.versions(RUN) == [0, 1, 2]
    check_all(board, expected)


def test_an_outage_longer_than_outage_s_stops_the_publisher() -> None:
    store, board, pub, masters = into_outage(13, PublisherConfig(outage_s=1.0))
    pub.publish(copy_masters(masters))
    with pytest.raises(TransientStoreError, match=r"more than outage_s=1") as stopped:
        pub.flush(timeout=30)
    assert "injected outage" in str(stopped.value)
    with pytest.raises(TransientStoreError):
        pub.publish(copy_masters(masters))
    pub.close()  # already reported
    store.down.clear()
    assert board.versions(RUN) == [0]


def test_outage_s_zero_stops_at_the_first_failure() -> None:
    store, _, pub, masters = into_outage(14, PublisherConfig(outage_s=0), asynchronous=False)
    with pytest.raises(TransientStoreError, match="injected outage") as stopped:
        pub.publish(copy_masters(masters))
    assert "outage_s" not in str(stopped.value)  # the store's own error, as before
    assert len([k for k in store.failed if not k.endswith("PUBLISHER")]) == 1  # no retry
    pub.close()


def test_close_during_an_outage_stops_waiting_at_once() -> None:
    store, board, pub, masters = into_outage(15, PublisherConfig(outage_s=3600))
    pub.publish(copy_masters(masters))
    _wait_failures(store)
    t0 = time.monotonic()
    with pytest.raises(TransientStoreError, match="injected outage"):
        pub.close()
    assert time.monotonic() - t0 < 10  # not the hour of outage_s
    store.down.clear()
    latest = board.latest(RUN)
    assert board.versions(RUN) == [0]
    assert latest is not None and latest.version == 0


def test_a_real_s3_outage_is_ridden_out(request: pytest.FixtureRequest) -> None:
    """moto's S3 server in its own process, reached through a TCP link that goes away for a
    while (connections refused, as when an endpoint or its network is down) and comes back on
    the same port: botocore's retries are spent, the publisher rides it out, and every
    version published around it reconstructs bit for bit."""
    import urllib.parse

    from rollpatch.netem import Link
    from rollpatch.store import open_store
    from tests.conftest_s3 import BUCKET, S3_SMALL_PARTS
    from tests.s3server import S3Server

    server: S3Server = request.getfixturevalue("s3_server")
    up = urllib.parse.urlsplit(server.endpoint_url)
    upstream = (up.hostname or "127.0.0.1", up.port or 80)
    link = Link(upstream=upstream).start()
    port = link.port
    opts = {**S3_SMALL_PARTS, "max_attempts": 2, "connect_timeout": 1.0, "read_timeout": 5.0}
    store = open_store(
        f"s3://{BUCKET}/outage-{uuid.uuid4().hex[:12]}",
        **server.options(**opts, endpoint_url=f"http://127.0.0.1:{port}"),
    )
    board = Board(store)
    masters = random_masters(seed=16)
    expected = {}
    pub = Publisher(board, RUN, PublisherConfig(outage_s=120))
    try:
        expected[pub.publish(copy_masters(masters))] = copy_masters(masters)
        pub.flush(timeout=60)
        link.close()  # the endpoint is gone: connection refused
        for i in range(3):
            nudge(masters, seed=70 + i)
            expected[pub.publish(copy_masters(masters))] = copy_masters(masters)
            time.sleep(0.3)
        t0 = time.monotonic()
        while pub.stats.outage_since_s is None:
            assert time.monotonic() - t0 < 60, "the publisher never met the outage"
            time.sleep(0.05)
        link = Link(upstream=upstream, listen=("127.0.0.1", port)).start()  # back
        pub.flush(timeout=120)
        assert pub.stats.outages == 1
        pub.close()
        latest = board.latest(RUN)
        assert latest is not None and latest.version == 3
        check_all(board, expected)
    finally:
        pub.close()
        link.close()
