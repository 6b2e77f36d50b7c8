"""The gateway's view of its fleet against hostile islands (audit p39a, findings 5, 6, 8, 10,
11): ``/version`` polls bounded in bytes and in time, the in-flight count of a caller that
hung up, islands of another run, state changes logged, the request head bounds. Fake islands
and helpers: test_gateway_hostile.py."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")

import httpx
import openai

from rollpatch.gateway import Gateway, GatewayConfig
from rollpatch.gateway.server import RunningGateway
from rollpatch.types import Constraint
from tests.conftest import until
from tests.test_gateway_hostile import (
    Fake,
    Handler,
    client,
    complete,
    fakes,
    gateway,
    labelled,
    pour,
    sample,
)

_FIXTURES = (fakes,)  # used by name

POLL = GatewayConfig(poll_s=0.05, poll_timeout_s=0.5, retry_backoff_s=0.01)


def _island(gw: RunningGateway, name: str) -> dict[str, Any]:
    return next(i for i in httpx.get(f"{gw.url}/islands").json()["islands"] if i["name"] == name)


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [r.rp_fields for r in caplog.records if getattr(r, "rp_event", None) == name]  # type: ignore[attr-defined]


# ---- /version polls (findings 5 and 6) ------------------------------------------------------


def _version_head(h: Handler, length: int | None) -> None:
    h.send_response(200)
    h.send_header("content-type", "application/json")
    h.send_header("content-length" if length else "connection", str(length) if length else "close")
    h.end_headers()
    h.close_connection = True


def test_a_version_answer_announcing_more_than_1_mib_is_refused_unread(
    fakes: list[Fake],
) -> None:
    """``Content-Length`` over the limit, body never sent: refused for its size at once (read
    first, the poll would only have timed out)."""
    stop = threading.Event()

    def version(h: Handler) -> None:
        _version_head(h, 300 << 20)
        stop.wait(30)

    fakes.append(Fake(labelled(1), version_get=version))
    gw = gateway({"huge": fakes[-1]}, POLL)
    try:
        until(lambda: _island(gw, "huge")["reachable"] is False, "the poll to fail")
        assert "over the limit of 1,048,576" in _island(gw, "huge")["last_error"]
    finally:
        stop.set()
        gw.stop()


def test_an_endless_version_answer_is_cut_at_1_mib(fakes: list[Fake]) -> None:
    """No ``Content-Length``, bytes without end, fast: refused once 1 MiB has come, not
    downloaded whole (nor until the deadline)."""
    sent: list[int] = []

    def version(h: Handler) -> None:
        _version_head(h, None)
        sent.append(pour(h, b" ", 256 << 20))

    fakes.append(Fake(labelled(1), version_get=version))
    # a deadline a loaded machine cannot reach before 1 MiB has come (at POLL's 0.5 s, CI on
    # two busy cores once cut the answer by its deadline first: session 44)
    gw = gateway({"endless": fakes[-1]}, replace(POLL, poll_timeout_s=30.0))
    try:
        until(lambda: sent, "a poll to end")
        assert "over the limit of 1,048,576" in _island(gw, "endless")["last_error"]
        assert sent[0] < 64 << 20
    finally:
        gw.stop()


def test_a_trickling_island_is_unreachable_and_its_request_goes_elsewhere(
    fakes: list[Fake], caplog: pytest.LogCaptureFixture
) -> None:
    """``/version`` sends a byte every 0.1 s and never ends (each read is quick, the answer
    never complete); its completions never answer. The poll's deadline makes it unreachable,
    and a request sent there is given up and answered by another island."""
    caplog.set_level(logging.INFO, logger="rollpatch.gateway")
    stop = threading.Event()

    def version(h: Handler) -> None:
        _version_head(h, None)
        h.wfile.write(b'{"run": "r1", "served": 1,')
        while not stop.wait(0.1):
            try:
                h.wfile.write(b" ")
                h.wfile.flush()
            except OSError:
                return

    def never(h: Handler, body: dict[str, Any]) -> None:
        stop.wait(60)

    fakes += [Fake(never, version_get=version), Fake(labelled(1))]
    gw = gateway({"trickle": fakes[0], "ok": fakes[1]}, POLL)
    try:
        until(lambda: _island(gw, "trickle")["reachable"] is False, "the trickle to fail", 10)
        assert "no complete /version answer within 0.5 s" in _island(gw, "trickle")["last_error"]
        assert any(e["island"] == "trickle" for e in _events(caplog, "island_unreachable"))
        t0 = time.monotonic()
        for _ in range(3):
            assert complete(client(gw))["island"] == "ok"
        assert time.monotonic() - t0 < 20
        assert _island(gw, "trickle")["inflight"] == 0
    finally:
        stop.set()
        gw.stop()


def test_a_caller_that_hangs_up_does_not_leak_the_islands_inflight(fakes: list[Fake]) -> None:
    """An island that answers its polls but holds a request: the caller gives up after 1 s;
    the gateway gives the request up too (its in-flight count back to 0, ``client_gone``)."""
    release = threading.Event()
    fakes.append(Fake(lambda h, b: release.wait(60)))
    gw = gateway({"slow": fakes[-1]}, POLL)
    try:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="-", max_retries=0, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):
            complete(c)
        until(lambda: gw.gateway.inflight() == 0, "the in-flight count to drop", 10)
        assert sample(gw, "slow", "client_gone") == 1
    finally:
        release.set()
        gw.stop()


# ---- runs (finding 8) -----------------------------------------------------------------------


def test_islands_of_another_run_get_no_requests(
    fakes: list[Fake], caplog: pytest.LogCaptureFixture
) -> None:
    """Two islands follow g (serving 1), one follows r1 (serving 2): ``exact_version: 2`` is
    never answered from r1's version 2; the odd one is named in a WARNING, in ``/islands``
    and in the metrics."""
    caplog.set_level(logging.INFO, logger="rollpatch.gateway")
    conflict = {"error": {"message": "not yet"}, "served": 1, "latest": 1}
    g = [Fake(lambda h, b: h.reply(409, conflict), run="g") for _ in range(2)]
    other = Fake(labelled(2), served=2, run="r1")
    fakes += [*g, other]
    gw = gateway({"g1": g[0], "other": other, "g2": g[1]}, POLL)
    try:
        until(lambda: gw.gateway.excluded() == {"other"}, "the odd island to be excluded")
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as e:
                complete(client(gw), exact_version=2)
            assert e.value.status_code == 409
        assert not other.posts
        listing = httpx.get(f"{gw.url}/islands").json()
        assert listing["run"] == "g" and listing["latest"] == 1
        assert "follows run 'r1'" in _island(gw, "other")["excluded"]
        assert _island(gw, "g1")["excluded"] is None
        text = httpx.get(f"{gw.url}/metrics").text
        assert 'rollpatch_gateway_island_other_run{island="other"} 1.0' in text
        warned = [r for r in caplog.records if getattr(r, "rp_event", None) == "island_other_run"]
        # before every island answered its first poll the fleet's run may be another (one
        # island of each: a tie), and an island of g may be named first
        named = [r.rp_fields["island"] for r in warned]  # type: ignore[attr-defined]
        assert "other" in named and all(r.levelno == logging.WARNING for r in warned)
    finally:
        gw.stop()


def test_a_pinned_run_wins_over_the_majority(fakes: list[Fake]) -> None:
    g = [Fake(labelled(1), run="g") for _ in range(2)]
    mine = Fake(labelled(2), served=2, run="r1")
    fakes += [*g, mine]
    gw = gateway({"g1": g[0], "g2": g[1], "mine": mine}, GatewayConfig(poll_s=0.05, run="r1"))
    try:
        until(lambda: gw.gateway.excluded() == {"g1", "g2"}, "the other run excluded")
        assert {complete(client(gw))["island"] for _ in range(3)} == {"mine"}
        assert not g[0].posts and not g[1].posts
    finally:
        gw.stop()


# ---- logs (finding 10) ----------------------------------------------------------------------


def test_an_island_going_down_and_coming_back_is_logged_once_each(
    fakes: list[Fake], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rollpatch.gateway")
    down = threading.Event()

    def version(h: Handler) -> None:
        if down.is_set():
            h.reply(500, {"error": "sick"})
        else:
            h.reply(200, h.fake.version)

    fakes.append(Fake(labelled(1), version_get=version))
    gw = gateway({"flaky": fakes[-1]}, POLL)
    try:
        down.set()
        until(lambda: _island(gw, "flaky")["reachable"] is False, "it to go down")
        time.sleep(0.3)  # several failed polls: one line
        down.clear()
        until(lambda: _island(gw, "flaky")["reachable"], "it to come back")
        assert len(_events(caplog, "island_unreachable")) == 1
        assert "500" in _events(caplog, "island_unreachable")[0]["error"]
        assert len(_events(caplog, "island_up")) == 2  # the first poll, then the return
    finally:
        gw.stop()


# ---- request heads (finding 11) -------------------------------------------------------------


def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_request_heads_are_bounded_as_the_sidecars(fakes: list[Fake]) -> None:
    fakes.append(Fake(labelled(1)))
    gw = gateway({"a": fakes[-1]}, POLL)
    try:
        big = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 70_000 + b"\r\n\r\n"
        assert _raw(gw.url, big).startswith(b"HTTP/1.1 400"), "a 70 KB head"
        body = json.dumps({"prompt": "x"}).encode()
        both = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 5\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n"
            % (len(body), body)
        )
        assert _raw(gw.url, both).startswith(b"HTTP/1.1 400"), "Content-Length with chunked"
        assert not fakes[-1].posts
        ok = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        assert _raw(gw.url, ok).startswith(b"HTTP/1.1 200")
    finally:
        gw.stop()


def test_the_fleets_run_is_the_majoritys_and_a_loading_island_does_not_outvote() -> None:
    """The rule without HTTP: most islands reporting a run, then most serving a version of it
    (a loading island of a run with nothing published, first to answer, loses a tie to a
    serving one); an island that goes down keeps its vote."""
    gw = Gateway(["a=http://a:1", "b=http://b:1", "c=http://c:1"])
    gw.observe_version("a", {"run": "empty", "served": None, "latest": None})
    assert gw.fleet_run() == "empty"
    gw.observe_version("b", {"run": "g", "served": 3, "latest": 3})
    assert gw.fleet_run() == "g" and gw.excluded() == {"a"}
    assert gw.latest() == 3 and gw.choose(Constraint(), [], None).name == "b"  # type: ignore[union-attr]
    gw.observe_version("c", {"run": "g", "served": 3, "latest": 3})
    gw.observe_failure("b", "down")
    gw.observe_failure("c", "down")
    gw.observe_version("a", {"run": "empty", "served": None, "latest": None})
    assert gw.fleet_run() == "g" and gw.excluded() == {"a"}
    assert gw.choose(Constraint(), [], None).name != "a"  # type: ignore[union-attr]
