"""Issue 11 (services that cannot be wedged): slow clients, typed bodies, a stale LATEST.

Every service is real (uvicorn on loopback, tests/hardenfix.py); slow clients are raw
sockets; clients are the ones users run (httpx, the relay's ``http(s)://`` store client).
TLS and bearer tokens: test_hardening_tls.py.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi", reason="the web extra installs fastapi")

from rollpatch.board import Board
from rollpatch.engines.view_engine import ViewEngine
from rollpatch.errors import ConfigError
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.serving import ServeOptions
from rollpatch.serving.body import BodyLimits
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import start_sidecar
from tests.conftest import dead_url
from tests.hardenfix import RUN, board, gateway, relay, sidecar

_FIXTURES = (board, relay)  # used by name


# -- slow clients ----------------------------------------------------------------------------


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _closed_by_server(sock: socket.socket, limit_s: float = 30.0) -> bytes:
    """Read until the server closes the connection (what it said on the way out)."""
    sock.settimeout(limit_s)
    got = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return got
        got += chunk


def test_slowloris_connections_are_cut_and_others_still_served(relay: RelayServer) -> None:
    """A client that trickles its request head (or sends nothing) holds a connection only
    for the head timeout; meanwhile other clients are served."""
    port = _port(relay.url)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
    slow: list[socket.socket] = []
    for i in range(40):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2:
            s.sendall(head[:5])  # half of them start a head, the others say nothing
        slow.append(s)
    try:
        for step in range(3):  # keep trickling, well under the server's patience per byte
            for i, s in enumerate(slow):
                if i % 2:
                    try:
                        s.sendall(head[5 + step : 6 + step])
                    except OSError:
                        pass  # already cut
            assert httpx.get(f"{relay.url}/health", timeout=10).status_code == 200
            time.sleep(0.2)
        said = [_closed_by_server(s) for s in slow]
    finally:
        for s in slow:
            s.close()
    assert all(w.startswith(b"HTTP/1.1 408") for w in said), said[:3]
    assert httpx.get(f"{relay.url}/health", timeout=10).status_code == 200


def test_a_complete_head_is_not_cut_and_keep_alive_works(relay: RelayServer) -> None:
    with httpx.Client(timeout=10) as client:
        for _ in range(3):
            assert client.get(f"{relay.url}/health").status_code == 200
            time.sleep(0.6)  # under keep-alive, and each new head arrives at once


def test_slow_body_gets_408_and_frees_the_connection() -> None:
    gw = gateway(
        [f"a={dead_url()}"],
        body=BodyLimits(timeout_s=1.0),
        options=ServeOptions(header_timeout_s=5.0),
    )
    try:
        s = socket.create_connection(("127.0.0.1", _port(gw.url)))
        try:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"pro'
            )
            said = _closed_by_server(s)
        finally:
            s.close()
        assert said.startswith(b"HTTP/1.1 408"), said[:200]
        assert b"not received within" in said
        assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200
    finally:
        gw.stop()


def test_a_body_longer_than_its_content_length_logs_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """The bytes past Content-Length parse as a broken second head: 400 and a lingering
    close. The first request, still being answered (its cut body is not JSON: 400), used to
    write after the FIN: ``RuntimeError: Cannot call write() after write_eof()`` and an
    ERROR traceback in the log, at any client's will."""
    import logging

    sc = sidecar(tmp_path)  # the sidecar's httptools protocol parses pipelined heads at once
    try:
        with caplog.at_level(logging.INFO):
            s = socket.create_connection(("127.0.0.1", _port(sc.url)))
            try:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 10\r\n\r\n"
                    b'{"model":"m","prompt":"hi"}'
                )
                said = _closed_by_server(s)
            finally:
                s.close()
            time.sleep(0.3)  # the first request's handler finishes
        assert b" 400 " in said.split(b"\r\n", 1)[0], said[:200]
        logged = caplog.text + capfd.readouterr().err  # uvicorn's loggers may not propagate
        assert "Traceback" not in logged and "Exception in ASGI" not in logged, logged[-2000:]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert httpx.get(f"{sc.url}/health", timeout=10).status_code == 200
    finally:
        sc.stop()


def test_oversized_request_head_is_refused(relay: RelayServer) -> None:
    s = socket.create_connection(("127.0.0.1", _port(relay.url)))
    try:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000)
        except OSError:
            pass  # the server may cut us off mid-send: it does not buffer without bound
        said = _closed_by_server(s)
    except ConnectionResetError:
        said = b"reset"
    finally:
        s.close()
    assert said.startswith(b"HTTP/1.1 400") or said == b"reset", said[:100]
    assert httpx.get(f"{relay.url}/health", timeout=10).status_code == 200


# -- typed request bodies --------------------------------------------------------------------

BAD_BODIES = [
    ({"max_tokens": 1}, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": [1, -5]}, "prompt"),
    ({"prompt": "x", "stop": ["s"] * 100}, "stop"),
    ({"prompt": "x", "rollpatch": {"min_version": -1}}, "min_version"),
    ({"prompt": "x", "rollpatch": {"wait_s": 1e9}}, "wait_s"),
    ({"prompt": "x", "rollpatch": {"later": 1}}, "later"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
]


def test_bodies_are_validated_into_typed_models(tmp_path: Path) -> None:
    sc = sidecar(tmp_path)
    gw = gateway([f"a={sc.url}"])
    try:
        for url in (sc.url, gw.url):
            for body, field in BAD_BODIES:
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
                assert r.status_code == 400, (url, body, r.status_code, r.text[:200])
                message = r.json()["error"]["message"]
                assert field in message, (body, message)
            for body in (
                {"messages": []},
                {"messages": [{"content": "hi"}]},
                {"messages": [{"role": "user"}], "logprobs": 3},
            ):
                r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
                assert r.status_code == 400, (body, r.text[:200])
            # well-typed, with engine-specific extras passed through: only "not loaded" now
            ok = {
                "prompt": [[1, 2], [3]],
                "max_tokens": 2,
                "return_token_ids": True,
                "rollpatch": {"min_version": 0, "wait_s": 0},
            }
            assert httpx.post(f"{url}/v1/completions", json=ok, timeout=30).status_code == 503
        assert sc.sidecar.gate.inflight == 0
        schema = httpx.get(f"{sc.url}/openapi.json").json()
        body_schema = schema["paths"]["/v1/completions"]["post"]["requestBody"]
        props = body_schema["content"]["application/json"]["schema"]["properties"]
        assert {"prompt", "max_tokens", "rollpatch", "stream"} <= set(props)
        assert props["rollpatch"]["anyOf"][0]["additionalProperties"] is False
    finally:
        gw.stop()
        sc.stop()


def test_options_are_validated() -> None:
    for bad in (
        {"header_timeout_s": 0},
        {"header_timeout_s": float("nan")},
        {"max_header_bytes": 10},
        {"max_connections": 0},
        {"token": "two words"},
        {"token": ""},
        {"tls_key": "k.pem"},
    ):
        with pytest.raises(ConfigError):
            ServeOptions(**bad)  # type: ignore[arg-type]


# -- a stale LATEST ------------------------------------------------------------------------------


def test_max_lag_is_refused_while_latest_cannot_be_read(board: Board, tmp_path: Path) -> None:
    """Found by bench/soak.py: with its relay down, an island kept answering ``max_lag``
    requests from a LATEST it could no longer read, 11 versions behind the real one."""
    import numpy as np

    from rollpatch.follower import FollowerConfig
    from rollpatch.publisher import Publisher

    pub = Publisher(board, RUN, asynchronous=False)
    pub.publish({"w": np.ones((4, 4), np.float32)})
    pub.flush()
    relay = RelayServer(board.store, RelayConfig(cache_dir=tmp_path / "c"))
    relay.start()
    sc = start_sidecar(
        relay.url,
        RUN,
        ViewEngine(),
        dead_url(),  # generation: unreachable
        config=SidecarConfig(latest_max_age_s=1.0, follower=FollowerConfig(poll_s=0.05)),
    )
    try:
        deadline = time.monotonic() + 30
        while sc.sidecar.follower.version != 0:
            assert time.monotonic() < deadline, "never loaded version 0"
            time.sleep(0.05)
        lagged = {"prompt": "x", "rollpatch": {"max_lag": 2, "wait_s": 0}}
        newer = {"prompt": "x", "rollpatch": {"min_version": 0}}
        url = f"{sc.url}/v1/completions"
        assert httpx.post(url, json=lagged, timeout=30).status_code == 502  # admitted
        relay.stop()
        time.sleep(1.5)
        r = httpx.post(url, json=lagged, timeout=60)
        assert r.status_code == 503 and "max_lag cannot be checked" in r.text, r.text
        assert r.json()["served"] == 0
        assert httpx.post(url, json=newer, timeout=60).status_code == 502  # still admitted
    finally:
        sc.stop()
        relay.stop()
