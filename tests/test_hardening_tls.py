"""Issue 11: TLS and bearer tokens on every service. TLS is a real handshake against a
certificate made in the test; clients are the ones users run (httpx, the relay's
``https://`` store client). The services: tests/hardenfix.py.
"""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi", reason="the web extra installs fastapi")

from rollpatch.board import Board
from rollpatch.errors import ConfigError
from rollpatch.gateway.server import RunningGateway
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.serving import ServeOptions
from rollpatch.store import open_store
from tests.hardenfix import RUN, TOKEN, board, gateway, relay, sidecar
from tests.tlsfix import self_signed

_FIXTURES = (board, relay)  # used by name


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
    sc = sidecar(tmp_path, options=tls)
    try:
        assert sc.url.startswith("https://")
        _handshake(sc.url, str(tls.tls_cert))
        assert httpx.get(f"{sc.url}/health", timeout=10).json() == {"status": "ok"}
        gw = gateway([f"a={sc.url}"], options=tls)  # the gateway polls the island over TLS
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
    sc = sidecar(tmp_path, options=ServeOptions(token=TOKEN))
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
        without = gateway([f"a={sc.url}"])
        gws.append(without)
        r = httpx.post(f"{without.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 401  # the island refused the gateway: not retried, passed on
        with_token = gateway(
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
