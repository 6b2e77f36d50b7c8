"""What a sidecar says without being asked (an observability audit, session 43): a LATEST it
cannot read and a run with no LATEST are WARNINGs from its board watch (L2, L7: silent for
130 s, and for good), ``rollpatch_ready`` follows ``/ready``'s own part (L7), and the served
version's creation time and publish -> serving age are metrics (L8)."""

from __future__ import annotations

import logging
import math
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from rollpatch.engines.reference import ReferenceEngine
from rollpatch.follower import FollowerConfig
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.boardwatch import BoardWatch
from rollpatch.sidecar.server import start_sidecar
from tests.conftest import until
from tests.sidecarfix import World, _wait_ready, world

_FIXTURES = (world,)  # used by name


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [
        dict(r.rp_fields, level=r.levelno)  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "rp_event", None) == name
    ]


def _stub(age: float, latest: int | None, version: int | None, read: bool) -> Any:
    """A sidecar as the watch sees it: LATEST read ``age`` s ago (inf: never)."""
    status = SimpleNamespace(
        latest=latest,
        version=version,
        latest_age_s=age if read else None,
        last_error=None,
        last_retry_error="TransientStoreError: timed out" if age > 1 else None,
    )
    return SimpleNamespace(
        run="r1",
        started_at=time.monotonic() - 100,
        draining=False,
        config=SimpleNamespace(latest_max_age_s=10.0),
        latest_age=lambda: age,
        follower=SimpleNamespace(status=lambda: status),
    )


def test_the_board_watch_says_stale_fresh_and_missing_latest_once_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="rollpatch.sidecar")
    watch = BoardWatch(_stub(3.0, 5, 5, True), period_s=1.0)
    watch.check()
    assert not caplog.records  # fresh: nothing to say
    for age in (30.0, 31.0, 32.0):  # a hung relay: said once, not once per look
        watch.sc = _stub(age, 5, 5, True)
        watch.check()
    stale = _events(caplog, "latest_stale")
    assert len(stale) == 1 and stale[0]["level"] == logging.WARNING
    assert stale[0]["age_s"] == 30.0 and "timed out" in stale[0]["last_retry_error"]
    watch.sc = _stub(0.5, 6, 6, True)
    watch.check()
    fresh = _events(caplog, "latest_fresh")
    assert len(fresh) == 1 and fresh[0]["stale_for_s"] >= 30.0
    # a run with no LATEST, once a read completed: said (the wrong --run of the audit)
    for _ in range(3):
        watch.sc = _stub(0.5, None, None, True)
        watch.check()
    missing = _events(caplog, "no_latest")
    assert len(missing) == 1 and missing[0]["run"] == "r1" and "--run" in missing[0]["hint"]
    # never read since a start 100 s ago: as stale as the sidecar is old
    caplog.clear()
    fresh_watch = BoardWatch(_stub(math.inf, None, None, False), period_s=1.0)
    fresh_watch.check()
    assert [e["age_s"] >= 100 for e in _events(caplog, "latest_stale")] == [True]
    assert not _events(caplog, "no_latest")  # no read completed: not known to be missing


def test_a_sidecar_on_a_run_with_no_latest_says_so_and_is_not_ready(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rollpatch")
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    cfg = SidecarConfig(latest_max_age_s=1.0, follower=FollowerConfig(poll_s=0.05))
    sc = start_sidecar(world.board, "no-such-run", engine, engine.url, config=cfg)
    try:
        until(lambda: _events(caplog, "no_latest"), "the no_latest line", 20)
        metrics = httpx.get(f"{sc.url}/metrics").text
        assert "\nrollpatch_ready 0.0" in metrics
        assert "\nrollpatch_served_published_timestamp_seconds NaN" in metrics
        assert httpx.get(f"{sc.url}/ready").status_code == 503
    finally:
        sc.stop()


def test_a_serving_sidecar_exports_the_served_versions_age(world: World) -> None:
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    cfg = SidecarConfig(follower=FollowerConfig(poll_s=0.05))
    sc = start_sidecar(world.board, "r1", engine, engine.url, config=cfg)
    try:
        _wait_ready(sc)
        before = time.time()
        want = world.publish()
        until(lambda: sc.sidecar.follower.version == want, "the new version", 60)
        reg = sc.sidecar.metrics.registry
        sc.sidecar.refresh_metrics()
        assert reg.get_sample_value("rollpatch_ready") == 1.0
        created = reg.get_sample_value("rollpatch_served_published_timestamp_seconds")
        assert created is not None and before - 1 <= created <= time.time()
        ages = reg.get_sample_value("rollpatch_commit_age_seconds_count")
        assert ages is not None and ages >= 1
        slow = reg.get_sample_value("rollpatch_proxy_seconds_bucket", {"le": "300.0"})
        assert slow is not None  # buckets reach minutes-long generations (L13)
    finally:
        sc.stop()
