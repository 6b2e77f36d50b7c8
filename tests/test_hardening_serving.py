"""Issue 11 (services that cannot be wedged): slow clients, TLS, bearer tokens, typed bodies.

Every service is real (uvicorn on loopback); slow clients are raw sockets; TLS is a real
handshake against a certificate made in the test; clients are the ones users run (httpx, the
relay's ``http(s)://`` store client).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi", reason="the web extra installs fastapi")

from rollpatch.board import Board
from rollpatch.engines.view_engine import ViewEngine
from rollpatch.errors import ConfigError
from rollpatch.gateway import GatewayConfig
from rollpatch.gateway.server import RunningGateway, start_gateway
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.serving import ServeOptions
from rollpatch.serving.body import BodyLimits
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import RunningSidecar, start_sidecar
from rollpatch.store import open_store
from tests.conftest import dead_url
from tests.tlsfix import self_signed

RUN = "r1"
TOKEN = "t0ken-xyz"


@pytest.fixture
def board(memory_board: Board) -> Board:
    return memory_board


@pytest.fixture
def relay(board: Board, tmp_path: Path) -> Iterator[RelayServer]:
    server = RelayServer(
        board.store,
        RelayConfig(cache_dir=tmp_path / "cache"),
        options=ServeOptions(header_timeout_s=1.0),
    )
    server.start()
    yield server
    server.stop()


def _sidecar(
    tmp_path: Path, options: ServeOptions | None = None, **config: object
) -> RunningSidecar:
    """A sidecar of a run that has nothing published (its engine is never reached)."""
    return start_sidecar(
        f"file://{tmp_path / 'board'}",
        RUN,
        ViewEngine(),
        dead_url(),
        config=SidecarConfig(**config),
        options=options,
    )  # type: ignore[arg-type]


def _gateway(
    islands: list[str], options: ServeOptions | None = None, **config: object
) -> RunningGateway:
    return start_gateway(
        islands,
        config=GatewayConfig(poll_s=0.05, **config),  # type: ignore[arg-type]
        options=options,
    )


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
    gw = _gateway(
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


# -- TLS -------------------------------------------------------------------------------------


@pytest.fixture
def tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServeOptions:
    cert, key = self_signed(tmp_path / "tls")
    # how clients are told to trust a private CA: the standard variable (httpx, urllib)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    return ServeOptions(tls_cert=str(cert), tls_key=str(key))


def _handshake(url: str, cert: str) -> dict[str, object]:
    """A real TLS handshake: the certificate the server presented, verified against ours."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=cert)
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as s,
    ):
        assert s.version() in ("TLSv1.2", "TLSv1.3")
        peer = s.getpeercert()
        assert peer is not None
        return dict(peer)


def test_relay_over_tls(board: Board, tls: ServeOptions, tmp_path: Path) -> None:
    ref = board.put_object(RUN, b"patch bytes", "rpatch")
    server = RelayServer(board.store, RelayConfig(cache_dir=tmp_path / "c"), options=tls)
    server.start()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        assert _handshake(server.url, str(tls.tls_cert))["subject"]
        store = open_store(server.url, retries=0)  # urllib, trusting SSL_CERT_FILE
        assert store.get(ref.key) == b"patch bytes"
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port gets nowhere
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)
    finally:
        server.stop()


def test_sidecar_and_gateway_over_tls(tls: ServeOptions, tmp_path: Path) -> None:
    sc = _sidecar(tmp_path, options=tls)
    try:
        assert sc.url.startswith("https://")
        _handshake(sc.url, str(tls.tls_cert))
        assert httpx.get(f"{sc.url}/health", timeout=10).json() == {"status": "ok"}
        gw = _gateway([f"a={sc.url}"], options=tls)  # the gateway polls the island over TLS
        try:
            _handshake(gw.url, str(tls.tls_cert))
            deadline = time.monotonic() + 30
            while not gw.gateway.views()[0].reachable:
                assert time.monotonic() < deadline, gw.gateway.describe()
                time.sleep(0.05)
            r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x"}, timeout=30)
            assert r.status_code == 503  # forwarded over TLS: the island has no version yet
            assert r.headers["x-rollpatch-island"] == "a"
        finally:
            gw.stop()
    finally:
        sc.stop()


def test_bad_tls_files_are_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="go together"):
        ServeOptions(tls_cert=str(tmp_path / "junk.pem"))
    for cert in (tmp_path / "missing.pem", tmp_path / "junk.pem"):
        server = RelayServer(
            "memory://x",
            RelayConfig(cache_dir=tmp_path / "c"),
            options=ServeOptions(tls_cert=str(cert), tls_key=str(tmp_path / "junk.pem")),
        )
        with pytest.raises(ConfigError, match="tls_cert|TLS"):
            server.start()
        server.stop()


# -- bearer tokens ---------------------------------------------------------------------------


def test_relay_reads_need_the_token(board: Board, tmp_path: Path) -> None:
    ref = board.put_object(RUN, b"secret weights", "rpatch")
    server = RelayServer(
        board.store, RelayConfig(cache_dir=tmp_path / "c"), options=ServeOptions(token=TOKEN)
    )
    server.start()
    try:
        for path in (f"/v1/objects/{ref.key}", "/v1/list?prefix=runs/"):
            r = httpx.get(server.url + path, timeout=10)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            r = httpx.get(server.url + path, headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200  # health stays open
        store = open_store(server.url, retries=0, headers={"Authorization": f"Bearer {TOKEN}"})
        assert store.get(ref.key) == b"secret weights"
        with pytest.raises(Exception, match="401"):
            open_store(server.url, retries=0).get(ref.key)
    finally:
        server.stop()


def test_inference_needs_the_token_and_the_gateway_sends_it(tmp_path: Path) -> None:
    sc = _sidecar(tmp_path, options=ServeOptions(token=TOKEN))
    gws: list[RunningGateway] = []
    try:
        body = {"prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{sc.url}/v1/completions", json=body).status_code == 401
        r = httpx.post(
            f"{sc.url}/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        assert r.status_code == 503  # authorized: refused only because nothing is loaded
        assert httpx.get(f"{sc.url}/version").status_code == 200  # status routes stay open
        without = _gateway([f"a={sc.url}"])
        gws.append(without)
        r = httpx.post(f"{without.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 401  # the island refused the gateway: not retried, passed on
        with_token = _gateway(
            [f"a={sc.url}"], island_token=TOKEN, options=ServeOptions(token="gw-token")
        )
        gws.append(with_token)
        assert httpx.post(f"{with_token.url}/v1/completions", json=body).status_code == 401
        r = httpx.post(
            f"{with_token.url}/v1/completions",
            json=body,
            timeout=30,
            headers={"authorization": "Bearer gw-token"},
        )
        assert r.status_code == 503 and r.headers["x-rollpatch-island"] == "a"
    finally:
        for gw in gws:
            gw.stop()
        sc.stop()


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
    sc = _sidecar(tmp_path)
    gw = _gateway([f"a={sc.url}"])
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
