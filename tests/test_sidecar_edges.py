"""The sidecar's edges, end to end: bad and hostile requests never wedge the island, readiness
follows a wedged gate, a dead or unreachable engine and a version not yet loaded, the admin
token, and concurrent load while versions advance; the label of every response checked as in
tests/test_sidecar.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

import httpx

from rollpatch.engines.reference import ReferenceEngine
from rollpatch.follower import FollowerConfig
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import RunningSidecar, start_sidecar
from tests.conftest import until
from tests.sidecarfix import (
    MODEL,
    PROMPT,
    World,
    _client,
    _complete,
    _start,
    _wait_ready,
    sidecar,
    world,
)

_FIXTURES = (world, sidecar)  # used by name


def test_bad_requests(sidecar: RunningSidecar) -> None:
    registry = sidecar.sidecar.metrics.registry
    labels = {"outcome": "client_error"}
    before = registry.get_sample_value("rollpatch_requests_total", labels) or 0.0
    r = httpx.post(f"{sidecar.url}/v1/completions", content=b"{nope")
    assert r.status_code == 400
    r = httpx.post(
        f"{sidecar.url}/v1/completions", json={"prompt": "x", "rollpatch": {"min_version": "soon"}}
    )
    assert r.status_code == 400 and "min_version" in r.json()["error"]["message"]
    # refused before the engine: counted all the same
    assert registry.get_sample_value("rollpatch_requests_total", labels) == before + 2


def test_hostile_bodies_never_wedge_the_island(sidecar: RunningSidecar, world: World) -> None:
    """Issue 11: NaN/Infinity bodies leaked an admission slot; the next drain commit then
    waited forever and every later request hung. Now: 400/413, and the island keeps serving."""
    url = f"{sidecar.url}/v1/completions"
    json_ct = {"content-type": "application/json"}
    hostile = [
        b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}',
        b'{"prompt": "x", "max_tokens": 1, "temperature": Infinity}',
        b'{"prompt": "x", "max_tokens": 1, "top_p": -Infinity, "stream": true}',
        b'{"prompt": "x", "rollpatch": {"min_version": 1e400}}',
        b'{"prompt": "x", "logit_bias": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"prompt": "\\udc00"}',
    ]
    for _ in range(3):
        for raw in hostile:
            r = httpx.post(url, content=raw, headers=json_ct, timeout=30)
            assert r.status_code == 400, (raw[:60], r.status_code, r.text[:200])
            assert r.json()["error"]["type"] == "invalid_request_error"
    big = httpx.post(
        url, content=b'{"prompt": "' + b"x" * (16 << 20) + b'"}', headers=json_ct, timeout=60
    )
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    assert sidecar.sidecar.gate.inflight == 0
    v = world.publish()  # catching up needs a drain commit: it must not wait on a leaked slot
    body, _ = _complete(_client(sidecar), min_version=v, wait_s=30)
    assert body["rollpatch"]["version_start"] == body["rollpatch"]["version_end"] == v
    world.check(body["choices"][0], v)
    assert httpx.get(f"{sidecar.url}/ready").status_code == 200
    assert sidecar.sidecar.gate.inflight == 0


def test_ready_reflects_a_wedged_gate_and_a_dead_engine(sidecar: RunningSidecar) -> None:
    sc = sidecar.sidecar
    assert httpx.get(f"{sidecar.url}/ready").json()["ready"] is True
    sc.gate._busy_since = 0.0  # a weight change "running" since boot: far past admit_timeout_s
    try:
        r = httpx.get(f"{sidecar.url}/ready")
        assert r.status_code == 503 and "weight commit" in r.json()["error"]["message"]
    finally:
        sc.gate._busy_since = None
    assert httpx.get(f"{sidecar.url}/ready").status_code == 200


def test_ready_is_503_when_the_engine_is_unreachable(world: World) -> None:
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    # the follower commits through the adapter, but generation is served at a dead address
    sc = start_sidecar(
        world.board,
        "r1",
        engine,
        "http://127.0.0.1:9",
        config=SidecarConfig(follower=FollowerConfig(poll_s=0.05), ready_probe_s=1.0),
    )
    try:
        deadline = time.monotonic() + 60
        while sc.sidecar.follower.version is None:
            assert time.monotonic() < deadline, "never loaded a version"
            time.sleep(0.05)
        r = httpx.get(f"{sc.url}/ready")
        assert r.status_code == 503 and "engine unreachable" in r.json()["error"]["message"]
        r = httpx.get(f"{sc.url}/v1/models")  # was a 500 "internal error" and a traceback
        assert r.status_code == 502 and "engine unreachable" in r.json()["error"]["message"]
    finally:
        sc.stop()


def test_a_request_the_engine_does_not_answer_suspends_the_served_version(
    world: World,
) -> None:
    """The engine may have restarted from its checkpoint while unreachable: after a 502 the
    sidecar proxies nothing and labels nothing (503, /ready says why) until the audit has
    re-checked the engine; then it serves again."""
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    engine.remote = True  # as vLLM's and SGLang's adapters are: another process
    cfg = SidecarConfig(  # the audit's own period is long: the test runs its re-check
        follower=FollowerConfig(poll_s=0.05, audit_period_s=3600.0), ready_probe_s=0.05
    )
    sc = start_sidecar(world.board, "r1", engine, "http://127.0.0.1:9", config=cfg)
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    try:
        deadline = time.monotonic() + 60
        while sc.sidecar.follower.version is None:
            assert time.monotonic() < deadline, "never loaded a version"
            time.sleep(0.05)
        served = sc.sidecar.follower.version
        r = httpx.post(f"{sc.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 502 and "engine unreachable" in r.text
        r = httpx.post(f"{sc.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "contact with the engine was lost" in r.text
        assert httpx.get(f"{sc.url}/version").json()["served"] is None
        r = httpx.get(f"{sc.url}/ready")
        assert r.status_code == 503 and "re-checking" in r.json()["error"]["message"]
        auditor = sc.sidecar.follower.auditor
        assert auditor is not None and auditor.step() is not None  # the re-check
        assert sc.sidecar.gate.suspect is None and sc.sidecar.follower.version == served
        assert httpx.get(f"{sc.url}/version").json()["served"] == served
    finally:
        sc.stop()


def test_admin_token(sidecar: RunningSidecar) -> None:
    assert httpx.post(f"{sidecar.url}/admin/sync").status_code == 401
    r = httpx.post(
        f"{sidecar.url}/admin/sync", headers={"Authorization": "Bearer s3cret"}, timeout=60
    )
    assert r.status_code == 200 and isinstance(r.json()["version"], int)


def test_not_ready_is_503(world: World) -> None:
    sc = _start(world, run="nothing-published")
    try:
        r = httpx.post(f"{sc.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"]
        # "has no LATEST" once a read of the board has completed (before: the first read is
        # in progress, audit G-F4)
        deadline = time.monotonic() + 30
        while sc.sidecar.follower.status().latest_age_s is None:
            assert time.monotonic() < deadline, "LATEST was never read"
            time.sleep(0.01)
        ready = httpx.get(f"{sc.url}/ready")
        assert ready.status_code == 503
        assert "run 'nothing-published' has no LATEST" in ready.json()["error"]["message"]
        r = httpx.post(f"{sc.url}/admin/sync", timeout=30)  # no token configured here
        assert r.status_code == 404 and "nothing is published" in r.json()["error"]["message"]
    finally:
        sc.stop()


def test_ready_says_why_no_version_loads(world: World) -> None:
    """A sidecar whose model can never hold the run (other tensor names) stays not ready,
    and /ready says why (the last sync's error), not only that nothing is loaded."""
    import numpy as np

    from rollpatch.publisher import Publisher, PublisherConfig

    with Publisher(world.board, "alien", PublisherConfig(), asynchronous=False) as pub:
        pub.publish({"x.weight": np.ones((8, 8), np.float32)})
    sc = _start(world, run="alien")
    try:
        deadline, said = time.monotonic() + 60, ""
        while "the last sync failed" not in said:
            assert time.monotonic() < deadline, said
            r = httpx.get(f"{sc.url}/ready")
            assert r.status_code == 503
            said = r.json()["error"]["message"]
            time.sleep(0.05)
        # refused from the keyframe's header: the run's tensor is named, nothing fetched
        assert "IncompatibleModelError" in said and "'x.weight'" in said, said
        assert "start the engine with the model this run trains" in said
        r = httpx.post(f"{sc.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and "IncompatibleModelError" in r.json()["error"]["message"]
        version = httpx.get(f"{sc.url}/version").json()
        assert version["served"] is None and version["digest"] is None
        assert version["bytes_fetched"] == 0 and version["sync_failures"] >= 1
        metrics = httpx.get(f"{sc.url}/metrics").text
        assert "rollpatch_served_version -1.0" in metrics  # none, not version 0
        assert "rollpatch_sync_failing 1.0" in metrics
    finally:
        sc.stop()


def test_concurrent_load_while_versions_advance(sidecar: RunningSidecar, world: World) -> None:
    client = _client(sidecar)
    errors: list[BaseException] = []
    seen: set[int] = set()
    done = threading.Event()

    def worker() -> None:
        try:
            count = 0
            while not done.is_set() or count < 4:
                count += 1
                body, _ = _complete(client, max_lag=1, wait_s=30)
                v = body["rollpatch"]["version_start"]
                assert body["rollpatch"]["version_end"] == v
                world.check(body["choices"][0], v)
                seen.add(v)
        except BaseException as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for _ in range(3):
        world.publish()
        time.sleep(0.2)
    done.set()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert len(seen) >= 2, "versions should have advanced under load"


def test_pause_mode_reports_spanning_versions(world: World) -> None:
    sc = _start(world, mode="pause")
    try:
        _wait_ready(sc)
        client = _client(sc)
        _complete(client, min_version=max(world.expected), wait_s=60)
        spans = []
        for _ in range(5):
            out: dict[str, Any] = {}

            def long_request(out: dict[str, Any] = out) -> None:
                raw = client.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=400,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                out["rp"] = raw.model_dump()["rollpatch"]

            t = threading.Thread(target=long_request)
            t.start()
            time.sleep(0.1)
            world.publish()
            t.join(120)
            spans.append((out["rp"]["version_start"], out["rp"]["version_end"]))
            if spans[-1][0] != spans[-1][1]:
                break
        assert all(s <= e for s, e in spans)
        assert any(s < e for s, e in spans), f"no commit landed mid-generation: {spans}"
    finally:
        sc.stop()


def test_a_stalled_board_holds_no_request_and_not_version(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A board (a relay) that accepts and never answers: ``/version`` answers from the
    sidecar's state at once, a ``max_lag`` request and a ``min_version`` one past the known
    LATEST get 503 naming the board once ``latest_max_age_s`` passed (not "not published",
    not a hang), and plain requests are served by the version in place."""
    from rollpatch.board import Board
    from tests.relayfix import Counting

    class Stalling(Counting):
        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.stall, self.release = threading.Event(), threading.Event()

        def count(self, op: str, key: str) -> None:
            super().count(op, key)
            if self.stall.is_set() and key.endswith("LATEST"):
                self.release.wait(60)

    caplog.set_level(logging.INFO, logger="rollpatch")
    store = Stalling(Board(world.board).store)
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    cfg = SidecarConfig(
        latest_ttl_s=0.0, latest_max_age_s=1.0, follower=FollowerConfig(poll_s=0.05)
    )
    sc = start_sidecar(Board(store), "r1", engine, engine.url, config=cfg)
    try:
        _wait_ready(sc)
        served = httpx.get(f"{sc.url}/version").json()["served"]
        store.stall.set()
        time.sleep(1.5)  # the follower's loop and every request's read now hang
        t0 = time.monotonic()
        v = httpx.get(f"{sc.url}/version", timeout=10).json()
        assert time.monotonic() - t0 < 2 and v["served"] == served
        assert v["latest_age_s"] is not None and v["latest_age_s"] > 1.0
        for rp, said in (
            ({"max_lag": 0, "wait_s": 0}, "max_lag cannot be checked"),
            ({"min_version": served + 1, "wait_s": 0}, f"whether version {served + 1}"),
        ):
            t0 = time.monotonic()
            r = httpx.post(
                f"{sc.url}/v1/completions",
                json={"prompt": "x", "max_tokens": 1, "rollpatch": rp},
                timeout=30,
            )
            assert time.monotonic() - t0 < 5, rp
            assert r.status_code == 503 and said in r.json()["error"]["message"], r.text
            assert "the board or relay did not answer it" in r.json()["error"]["message"]
        r = httpx.post(f"{sc.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["rollpatch"]["version_end"] == served
        # each of those 503s is said, at WARNING: the operator hears the board is unread (L3)
        said = [
            rec.rp_fields["reason"]  # type: ignore[attr-defined]
            for rec in caplog.records
            if getattr(rec, "rp_event", None) == "refused" and rec.levelno == logging.WARNING
        ]
        assert any("max_lag cannot be checked" in x for x in said), said
        assert any(f"whether version {served + 1}" in x for x in said), said
        # and with no request at all, the board watch says LATEST went unread (L2)
        until(
            lambda: any(getattr(r, "rp_event", None) == "latest_stale" for r in caplog.records),
            "the latest_stale line",
            10,
        )
    finally:
        store.release.set()
        sc.stop()


def test_exact_version_catches_up_to_it_not_past_it(world: World) -> None:
    """An island behind (it polls rarely) asked for ``exact_version`` N with N+1 published:
    it syncs to N and serves the request there (before: it synced to LATEST, then refused
    the request as final, "older than the served version")."""
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    cfg = SidecarConfig(follower=FollowerConfig(poll_s=3600.0))
    sc = start_sidecar(world.board, "r1", engine, engine.url, config=cfg)
    try:
        _wait_ready(sc)
        have = sc.sidecar.follower.version
        assert have is not None
        want, newer = world.publish(), world.publish()
        body, _ = _complete(_client(sc), exact_version=want, wait_s=60)
        assert body["rollpatch"]["version_start"] == body["rollpatch"]["version_end"] == want
        world.check(body["choices"][0], want)
        assert sc.sidecar.follower.version in (want, newer)  # then it goes on to LATEST
    finally:
        sc.stop()


def test_a_stale_latest_says_why_when_the_follower_knows() -> None:
    """An expired (or refused) LATEST is not an unreachable board: the 503 says what the
    follower's last read met."""
    from types import SimpleNamespace

    from rollpatch.sidecar.satisfy import _stale

    def sidecar(err: str | None) -> Any:
        status = SimpleNamespace(last_error=err)
        return SimpleNamespace(follower=SimpleNamespace(status=lambda: status))

    said = _stale(sidecar("TrustError: LATEST has expired"), 8.2, "max_lag cannot be checked")
    assert said == (
        "LATEST has not been read for 8 s (the last read failed: TrustError: LATEST has "
        "expired): max_lag cannot be checked"
    )
    assert "(the board or relay did not answer it)" in _stale(sidecar(None), 8.0, "x")
    # a catch-up that timed out says why the follower did not get there (a corrupt object)
    from rollpatch.sidecar.satisfy import _last_failure

    err = "ObjectIntegrityError: object does not match its manifest entry"
    assert _last_failure(sidecar(err)) == f"; the last sync failed: {err}"
    assert _last_failure(sidecar(None)) == ""


def test_shutdown_drains_streams_in_flight_and_refuses_new_requests(world: World) -> None:
    """What `rollpatch sidecar` does on SIGTERM (--shutdown-grace): new requests get 503 (a
    gateway sends them elsewhere) and /ready says why, while a stream in flight runs to its
    end; the drain returns once none is left."""
    sc = _start(world)
    try:
        _wait_ready(sc)
        body = {"prompt": PROMPT, "max_tokens": 64, "stream": True, "ignore_eos": True}
        done: list[bool] = []
        with httpx.stream("POST", f"{sc.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert first.startswith("data: {")
            drainer = threading.Thread(target=lambda: done.append(sc.sidecar.drain(30.0)))
            drainer.start()
            until(lambda: sc.sidecar.draining, "draining")
            refused = httpx.post(f"{sc.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503 and "shutting down" in refused.text
            ready = httpx.get(f"{sc.url}/ready")
            assert ready.status_code == 503 and "shutting down" in ready.text
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and len(rest) > 2  # the stream ran to its end
        drainer.join(30)
        assert done == [True]
    finally:
        sc.stop()
