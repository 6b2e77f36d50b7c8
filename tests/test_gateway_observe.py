"""What the gateway tells its operators (audit of observability, findings 1-4): the lag of a
stuck island, one ``refused`` line per kind with the island's reason, ``/ready`` and
``/health``'s ``fresh``, the latency buckets. Fake islands: test_gateway_hostile.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")

import httpx

from rollpatch.gateway import GatewayConfig, IslandView
from rollpatch.gateway.metrics import GatewayMetrics
from rollpatch.gateway.routing import fleet_latest, fleet_newest
from rollpatch.gateway.server import RunningGateway
from rollpatch.logs import Throttle
from tests.conftest import until
from tests.test_gateway_hostile import Fake, Handler, fakes, gateway, labelled

_FIXTURES = (fakes,)  # used by name

POLL = GatewayConfig(poll_s=0.05, poll_timeout_s=1.0, retry_backoff_s=0.01)
BODY = {"model": "m", "prompt": "x", "max_tokens": 2}


def _gauge(gw: RunningGateway, name: str, **labels: str) -> float | None:
    httpx.get(f"{gw.url}/metrics").raise_for_status()  # refreshes the island gauges
    return gw.gateway.metrics.registry.get_sample_value(name, labels)


def _island(gw: RunningGateway, name: str) -> dict[str, Any]:
    return next(i for i in httpx.get(f"{gw.url}/islands").json()["islands"] if i["name"] == name)


# ---- finding 1: a stuck island's lag ---------------------------------------------------------


def test_a_stuck_islands_lag_is_measured_from_the_newest_island(fakes: list[Fake]) -> None:
    """Two islands: one stuck on 44 (its relay hung: it reports LATEST 44), one on 200. The
    lower median (routing's LATEST) is 44, which showed the stuck island's lag as 0; its lag
    is 156, in the gauge and in ``/islands``, and both fleet LATESTs are exported."""
    stuck, good = Fake(labelled(44), served=44), Fake(labelled(200), served=200)
    fakes += [stuck, good]
    gw = gateway({"stuck": stuck, "good": good}, POLL)
    try:
        until(lambda: all(v.reachable for v in gw.gateway.views()), "both islands polled")
        lag = "rollpatch_gateway_island_lag_versions"
        assert _gauge(gw, lag, island="stuck") == 156
        assert _gauge(gw, lag, island="good") == 0
        assert _island(gw, "stuck")["lag"] == 156 and _island(gw, "good")["lag"] == 0
        fleet = "rollpatch_gateway_fleet_latest_version"
        assert _gauge(gw, fleet, basis="median") == 44  # routing keeps the median
        assert _gauge(gw, fleet, basis="newest") == 200
        assert gw.gateway.latest() == 44 and gw.gateway.newest() == 200
    finally:
        gw.stop()


def test_one_islands_inflated_latest_moves_no_lag() -> None:
    """A LATEST one island alone reports (a tampered board's) is not the newest version: a
    version some island serves is, or the median when higher."""

    def view(name: str, served: int | None, latest: int | None, up: bool = True) -> IslandView:
        return IslandView(name, f"http://{name}:1", served=served, latest=latest, reachable=up)

    liar = view("liar", 5, 10**12)
    assert fleet_newest([view("a", 5, 5), liar]) == 5
    assert fleet_newest([view("a", 44, 44), view("b", 200, 200)]) == 200
    assert fleet_latest([view("a", 44, 44), view("b", 200, 200)]) == 44
    # the median wins when it is higher (islands catching up to a LATEST most of them see)
    assert fleet_newest([view("a", 3, 9), view("b", 4, 9), view("c", None, 9)]) == 9
    assert fleet_newest([view("a", 7, 7), view("down", 90, 90, up=False)]) == 7
    assert fleet_newest([]) is None


# ---- finding 2: refusal lines ----------------------------------------------------------------


def _refusals(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "rp_event", None) == "refused"]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return record.rp_fields  # type: ignore[attr-defined,no-any-return]


def test_refusals_are_one_line_per_kind_with_the_islands_reason(
    fakes: list[Fake], caplog: pytest.LogCaptureFixture
) -> None:
    """100 refused requests: one line (409: INFO) carrying the island's reason, then, once
    the period is over, the next says how many were held back; a 503 is another kind, at
    WARNING."""
    caplog.set_level(logging.INFO, logger="rollpatch.gateway")
    reason = "behind: serving 1, the request needs 7 (the caller asked not to wait)"

    def post(h: Handler, body: dict[str, Any]) -> None:
        if body.get("rollpatch", {}).get("min_version") == 7:
            h.reply(409, {"error": {"message": reason}, "served": 1, "latest": 1, "reason": reason})
        else:
            h.reply(503, {"error": {"message": "the engine has not loaded a version yet"}})

    fakes.append(Fake(post))
    gw = gateway({"only": fakes[-1]}, POLL)
    now = [1000.0]
    gw.gateway.said = Throttle(logging.getLogger("rollpatch.gateway"), clock=lambda: now[0])
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for _ in range(100):
                r = c.post("/v1/completions", json={**BODY, "rollpatch": {"min_version": 7}})
                assert r.status_code == 409
            lines = _refusals(caplog)
            assert len(lines) == 1, [_fields(r) for r in lines]
            first = _fields(lines[0])
            assert lines[0].levelno == logging.INFO and first["status"] == 409
            assert first["reason"] == reason and "repeated" not in first
            assert first["tried"] == "only" and first["path"] == "/v1/completions"
            now[0] += 11
            c.post("/v1/completions", json={**BODY, "rollpatch": {"min_version": 7}})
            lines = _refusals(caplog)
            assert len(lines) == 2 and _fields(lines[1])["repeated"] == 99
            for _ in range(3):  # not ready: another kind, a WARNING
                assert c.post("/v1/completions", json=BODY).status_code == 503
            lines = _refusals(caplog)[2:]
            assert len(lines) == 1 and lines[0].levelno == logging.WARNING
            assert "has not loaded a version" in _fields(lines[0])["reason"]
    finally:
        gw.stop()


def test_a_refusals_reason_is_bounded(fakes: list[Fake], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rollpatch.gateway")
    fakes.append(Fake(lambda h, b: h.reply(409, {"error": {"message": "x" * 100_000}})))
    gw = gateway({"only": fakes[-1]}, POLL)
    try:
        assert httpx.post(f"{gw.url}/v1/completions", json=BODY, timeout=30).status_code == 409
        (line,) = _refusals(caplog)
        assert 0 < len(_fields(line)["reason"]) <= 300
    finally:
        gw.stop()


# ---- finding 3: /ready and /health's fresh ---------------------------------------------------


def test_ready_says_whether_an_island_can_serve_and_health_counts_fresh_ones(
    fakes: list[Fake],
) -> None:
    """Loading (nothing served) with a LATEST read 60 s ago: ``/ready`` 503 naming the island,
    ``fresh`` 0. Serving with a LATEST read just now: 200, ``fresh`` 1."""
    island = Fake(labelled(3))
    island.version.update(served=None, state="LOADING", latest_age_s=60.0)
    fakes.append(island)
    gw = gateway({"a": island}, POLL)
    try:
        r = httpx.get(f"{gw.url}/ready")
        assert r.status_code == 503, r.text
        assert "a: serves no version (state LOADING)" in r.json()["reason"]
        assert r.json()["error"]["type"] == "not_ready"
        health = httpx.get(f"{gw.url}/health").json()
        assert health["fresh"] == 0 and health["serving"] == 0 and health["reachable"] == 1
        island.version.update(served=3, latest=3, state="IDLE", latest_age_s=0.1)
        until(lambda: httpx.get(f"{gw.url}/ready").status_code == 200, "the island to serve")
        assert httpx.get(f"{gw.url}/ready").json() == {"ready": True, "islands": ["a"], "latest": 3}
        until(lambda: httpx.get(f"{gw.url}/health").json()["fresh"] == 1, "a fresh LATEST")
        island.version.update(latest_age_s=None)  # never read: not fresh
        until(lambda: httpx.get(f"{gw.url}/health").json()["fresh"] == 0, "a LATEST never read")
        island.version_get = lambda h: h.reply(500, {"error": "sick"})  # its polls fail
        until(lambda: httpx.get(f"{gw.url}/ready").status_code == 503, "the island to go")
        assert "a: unreachable" in httpx.get(f"{gw.url}/ready").json()["reason"]
    finally:
        gw.stop()


def test_ready_is_503_while_every_island_follows_another_run(fakes: list[Fake]) -> None:
    fakes.append(Fake(labelled(1), run="other"))
    gw = gateway({"a": fakes[-1]}, GatewayConfig(poll_s=0.05, run="mine"))
    try:
        r = httpx.get(f"{gw.url}/ready")
        assert r.status_code == 503 and "another run" in r.json()["reason"]
    finally:
        gw.stop()


# ---- finding 4: latency buckets --------------------------------------------------------------


def test_request_seconds_has_buckets_up_to_five_minutes() -> None:
    m = GatewayMetrics()
    m.answer(200, 45.0)  # a request that waited for catch-up
    m.answer(200, 200.0)
    sample = m.registry.get_sample_value
    name = "rollpatch_gateway_request_seconds_bucket"
    assert sample(name, {"le": "30.0"}) == 0
    assert sample(name, {"le": "60.0"}) == 1
    assert sample(name, {"le": "120.0"}) == 1
    assert sample(name, {"le": "300.0"}) == 2
