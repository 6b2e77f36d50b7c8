"""What a running sidecar tells an operator, over real sockets with the built-in engine:

- the live-weights audit in ``/metrics`` (audit G-F2): slices, bytes and mismatches, the
  same numbers as ``/version``, so a mismatch can be alerted on;
- ``rollpatch_lag_versions`` for an island that holds no version (audit G-F3): ``latest + 1``
  (every version missing), whether it never loaded one or lost the one it had;
- ``/ready`` while the first read of an unreachable board is still retrying (audit G-F4):
  that read is in progress (and why its attempts fail), not "the run has no LATEST".
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families

from rollpatch.follower import FollowerConfig
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import RunningSidecar, start_sidecar
from rollpatch.view import View
from tests.conftest import dead_url, until
from tests.refenginefix import audited_sidecar


def _metrics(sc: RunningSidecar) -> dict[str, float]:
    """``/metrics`` parsed as Prometheus text: sample name → value (unlabelled samples)."""
    text = httpx.get(f"{sc.url}/metrics").text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def _engine(model: Path) -> Any:
    from rollpatch.engines.reference import ReferenceEngine

    return ReferenceEngine.from_dir(model, threads=1)


def test_an_audit_mismatch_shows_in_metrics_and_the_lost_version_in_the_lag(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A weight flipped behind the sidecar's back: ``rollpatch_audit_mismatches_total`` goes
    to 1 (as ``/version``'s ``audit_mismatches``), and while the island re-syncs, holding no
    version, its lag is every version (``latest + 1``), not the 0 it had."""
    board = f"file://{tmp_path / 'board'}"
    eng = _engine(tiny_model)
    sc, latest = audited_sidecar(board, eng)
    released = threading.Event()
    try:
        until(lambda: sc.sidecar.follower.version == latest, "the first catch-up", 60)
        until(lambda: _metrics(sc)["rollpatch_audit_slices_total"] > 0, "an audit slice")
        m = _metrics(sc)
        assert m["rollpatch_audit_bytes_total"] > 0 and m["rollpatch_audit_mismatches_total"] == 0
        assert m["rollpatch_lag_versions"] == 0 and m["rollpatch_served_version"] == latest
        load = eng.load

        def held_load(view: View, version: int) -> None:  # the re-sync waits for the checks
            released.wait(30)
            load(view, version)

        eng.load = held_load
        with eng.runtime.commit() as view:  # a stray write: nothing updates any digest
            view[min(eng.runtime.view)].data[5] ^= np.uint16(1 << 3)
        until(
            lambda: _metrics(sc)["rollpatch_audit_mismatches_total"] == 1,
            "the mismatch in /metrics",
        )
        m = _metrics(sc)
        assert m["rollpatch_served_version"] == -1  # out of rotation, re-syncing
        assert m["rollpatch_latest_version"] == latest
        assert m["rollpatch_lag_versions"] == latest + 1  # the lost version: every version
        released.set()
        until(lambda: sc.sidecar.follower.version == latest, "the re-sync", 60)
        m = _metrics(sc)
        assert m["rollpatch_lag_versions"] == 0 and m["rollpatch_audit_mismatches_total"] == 1
        v = httpx.get(f"{sc.url}/version").json()
        assert v["audit_mismatches"] == 1
        assert v["audit_slices"] > 0 and v["audit_bytes"] > 0
        assert "_created" not in httpx.get(f"{sc.url}/metrics").text
    finally:
        released.set()
        sc.stop()
        eng.close()


def test_an_island_that_never_loads_a_version_lags_by_every_version(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The run's model is not the engine's (other tensor names): nothing is ever served, and
    ``rollpatch_lag_versions`` says ``latest + 1``, not 0 (``/version``'s ``lag`` is null)."""
    board = f"file://{tmp_path / 'board'}"
    with Publisher(board, "alien", PublisherConfig(), asynchronous=False) as pub:
        for _ in range(3):
            latest = pub.publish({"x.weight": np.ones((8, 8), np.float32)})
    eng = _engine(tiny_model)
    cfg = SidecarConfig(follower=FollowerConfig(poll_s=0.05))
    sc = start_sidecar(board, "alien", eng, eng.url, config=cfg)
    try:
        until(lambda: _metrics(sc)["rollpatch_sync_failing"] == 1, "the failed sync", 60)
        m = _metrics(sc)
        assert m["rollpatch_served_version"] == -1 and m["rollpatch_latest_version"] == latest
        assert m["rollpatch_lag_versions"] == latest + 1
        assert httpx.get(f"{sc.url}/version").json()["lag"] is None
    finally:
        sc.stop()
        eng.close()


def test_ready_says_the_first_read_of_an_unreachable_board_is_in_progress(
    tiny_model: Path,
) -> None:
    """A relay that refuses connections: while the first read of LATEST retries, ``/ready``
    says so (with the last attempt's error once one was retried), never that the run has no
    LATEST; once that read has failed for good, the last sync's error; and the lag is
    unknown (NaN), not 0."""
    eng = _engine(tiny_model)
    cfg = SidecarConfig(follower=FollowerConfig(poll_s=0.05, retries=2, backoff_s=0.2))
    sc = start_sidecar(dead_url(), "r1", eng, eng.url, config=cfg)
    said: list[str] = []

    def ready_says() -> str:
        r = httpx.get(f"{sc.url}/ready")
        assert r.status_code == 503
        said.append(r.json()["error"]["message"])
        return said[-1]

    try:
        first = ready_says()
        assert "the first read of the board is in progress" in first, first
        until(lambda: "last attempt:" in ready_says(), "a retried attempt's error", 60)
        assert "Connection refused" in said[-1] or "cannot connect" in said[-1], said[-1]
        assert "relay" in said[-1] or "Store" in said[-1], said[-1]
        until(lambda: "the last sync failed" in ready_says(), "the failed first read", 60)
        assert not [s for s in said if "has no LATEST" in s], said
        lag = _metrics(sc)["rollpatch_lag_versions"]
        assert math.isnan(lag)  # LATEST unknown
    finally:
        sc.stop()
        eng.close()


def test_ready_says_no_latest_once_a_read_found_none(tiny_model: Path, tmp_path: Path) -> None:
    """A reachable board whose run has no LATEST: once the first read has completed, the
    answer is "has no LATEST" (the run name is what to check)."""
    board = f"file://{tmp_path / 'board'}"
    with Publisher(board, "other", PublisherConfig(), asynchronous=False) as pub:
        pub.publish({"x.weight": np.ones((8, 8), np.float32)})
    eng = _engine(tiny_model)
    cfg = SidecarConfig(follower=FollowerConfig(poll_s=0.05))
    sc = start_sidecar(board, "r1", eng, eng.url, config=cfg)
    try:
        until(lambda: sc.sidecar.follower.status().latest_age_s is not None, "a read of LATEST")
        r = httpx.get(f"{sc.url}/ready")
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "run 'r1' has no LATEST on the board so far" in message, message
    finally:
        sc.stop()
        eng.close()
