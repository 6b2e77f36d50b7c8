"""The link emulator over real loopback sockets: bytes intact, delays at least as configured,
one cap shared by every connection, bounded, and shut down cleanly.

Only lower bounds on configured delays are asserted (a loaded machine is only ever slower);
throughput near the cap is measured in bench/netem.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rollpatch.errors import ConfigError
from rollpatch.netem import Link, LinkConfig, TokenBucket, parse_hostport

Handler = Callable[[socket.socket], None]


class _Server:
    """A threaded TCP server on loopback running ``handler`` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self._handler = handler
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._handler(conn)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def _echo(conn: socket.socket) -> None:
    while data := conn.recv(1 << 16):
        conn.sendall(data)


def _payload(n: int, seed: int) -> bytes:
    return b"".join(hashlib.sha256(f"{seed}:{i}".encode()).digest() for i in range(n // 32 + 1))[:n]


def _digest_then_payload(conn: socket.socket) -> None:
    """Reads to EOF, answers sha256(received) then 1 MiB of its own bytes, then closes."""
    h = hashlib.sha256()
    while data := conn.recv(1 << 16):
        h.update(data)
    conn.sendall(h.digest() + _payload(1 << 20, 7))


def _count(conn: socket.socket) -> None:
    """Reads to EOF, answers how many bytes came."""
    n = 0
    while data := conn.recv(1 << 16):
        n += len(data)
    conn.sendall(str(n).encode())


def _recv_all(s: socket.socket) -> bytes:
    out = bytearray()
    while data := s.recv(1 << 16):
        out += data
    return bytes(out)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = s.recv(n - len(out))
        if not data:
            raise ConnectionError("closed early")
        out += data
    return bytes(out)


@pytest.fixture()
def echo() -> Iterator[_Server]:
    srv = _Server(_echo)
    yield srv
    srv.close()


def _connect(link: Link) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", link.port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def test_bytes_pass_unchanged_both_ways() -> None:
    srv = _Server(_digest_then_payload)
    sent = _payload(3 << 20, 1)
    with Link(upstream=srv.address, latency_ms=2, mbps=2000) as link, _connect(link) as s:
        s.sendall(sent)
        s.shutdown(socket.SHUT_WR)  # the half-close travels through the link too
        got = _recv_all(s)
        assert got[:32] == hashlib.sha256(sent).digest()
        assert got[32:] == _payload(1 << 20, 7)
        deadline = time.monotonic() + 10
        while link.stats().bytes_down < len(got) and time.monotonic() < deadline:
            time.sleep(0.01)
        st = link.stats()
    assert (st.connections, st.bytes_up, st.bytes_down) == (1, len(sent), len(got))
    srv.close()


def test_added_latency_is_at_least_the_configured_one(echo: _Server) -> None:
    with Link(upstream=echo.address, latency_ms=30) as link, _connect(link) as s:
        t0 = time.perf_counter()
        s.sendall(b"first")
        assert _recv_exactly(s, 5) == b"first"
        first = time.perf_counter() - t0  # handshake round trip + one round trip
        rtts = []
        for i in range(3):
            t0 = time.perf_counter()
            s.sendall(b"%d" % i)
            assert _recv_exactly(s, 1) == b"%d" % i
            rtts.append(time.perf_counter() - t0)
    assert first >= 0.11
    assert min(rtts) >= 0.058


def test_bandwidth_cap_is_shared_by_concurrent_connections() -> None:
    srv = _Server(_count)
    each, rate = 400_000, 1e6  # 8 Mbit/s = 1 MB/s per direction, for the link
    cfg = LinkConfig(upstream=srv.address, mbps=8, burst_bytes=0, handshake=False)
    results: list[bytes] = []

    def send(link: Link) -> None:
        with _connect(link) as s:
            s.sendall(_payload(each, 2))
            s.shutdown(socket.SHUT_WR)
            results.append(_recv_all(s))

    with Link(cfg) as link:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=send, args=(link,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        elapsed = time.perf_counter() - t0
        assert link.stats().connections == 2
    assert results == [str(each).encode()] * 2
    # Separate caps would finish both in each/rate = 0.4 s; one shared cap needs 0.8 s.
    assert elapsed >= 0.95 * 2 * each / rate
    srv.close()


def test_loss_delays_but_never_corrupts(echo: _Server) -> None:
    data = _payload(300_000, 3)
    with Link(upstream=echo.address, latency_ms=1, loss=0.05, seed=1, chunk_bytes=8192) as link:
        with _connect(link) as s:
            reader = threading.Thread(target=lambda: got.append(_recv_exactly(s, len(data))))
            got: list[bytes] = []
            reader.start()
            s.sendall(data)
            reader.join(60)
        assert got == [data]
        assert link.stats().lost_segments > 0


def test_close_closes_every_connection(echo: _Server) -> None:
    link = Link(upstream=echo.address).start()
    port = link.port
    socks = [_connect(link) for _ in range(3)]
    for s in socks:
        s.sendall(b"hi")
        assert _recv_exactly(s, 2) == b"hi"
    assert link.stats().open == 3
    link.close()
    for s in socks:
        s.settimeout(10)
        try:
            assert s.recv(10) == b""
        except ConnectionResetError:
            pass
        s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    link.close()  # idempotent


def test_connections_are_bounded(echo: _Server) -> None:
    with Link(upstream=echo.address, max_connections=1) as link, _connect(link) as s:
        s.sendall(b"a")
        assert _recv_exactly(s, 1) == b"a"
        with _connect(link) as extra:
            try:
                assert extra.recv(1) == b""
            except ConnectionResetError:
                pass
        assert link.stats().refused == 1


def test_unreachable_upstream_closes_the_client() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    dead = probe.getsockname()[:2]
    probe.close()
    with Link(upstream=dead) as link, _connect(link) as s:
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        deadline = time.monotonic() + 10
        while link.stats().refused < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.stats().refused == 1


def test_listening_on_a_busy_port_names_it(echo: _Server) -> None:
    busy = echo.address[1]
    with pytest.raises(ConfigError, match=f"127.0.0.1:{busy}"):
        Link(upstream=echo.address, listen=("127.0.0.1", busy)).start()


def test_token_bucket_paces_and_bursts() -> None:
    b = TokenBucket(1000.0)
    assert b.reserve(500, 0.0) == pytest.approx(0.5)
    assert b.reserve(500, 0.0) == pytest.approx(1.0)  # shared: books after the first
    assert b.reserve(100, 5.0) == pytest.approx(5.1)  # idle time is not saved up without burst
    burst = TokenBucket(1000.0, burst=200)
    assert burst.reserve(200, 10.0) == pytest.approx(10.0)
    assert burst.reserve(100, 10.0) == pytest.approx(10.1)
    assert burst.backlog(10.0) == pytest.approx(0.1)
    assert TokenBucket(None).reserve(10**9, 3.0) == 3.0


@pytest.mark.parametrize(
    "field, value",
    [
        ("latency_ms", -1),
        ("mbps", 0),
        ("loss", 0.9),
        ("loss", float("nan")),
        ("chunk_bytes", 100),
        ("window_bytes", 10),
        ("max_connections", 0),
        ("upstream", ("h", 0)),
        ("listen", ("127.0.0.1", 70000)),
        ("handshake", 1),
    ],
)
def test_config_names_the_bad_field(field: str, value: object) -> None:
    fields: dict[str, object] = {"upstream": ("127.0.0.1", 80), field: value}
    with pytest.raises(ConfigError, match=f"LinkConfig.{field}"):
        LinkConfig(**fields)  # type: ignore[arg-type]


def test_default_window_covers_the_bandwidth_delay_product() -> None:
    cfg = LinkConfig(upstream=("127.0.0.1", 80), latency_ms=25, mbps=1000)
    assert cfg.window >= 125e6 * 0.05
    assert LinkConfig(upstream=("127.0.0.1", 80), mbps=1).window == 256 << 10


def test_parse_hostport() -> None:
    assert parse_hostport("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_hostport("[::1]:0") == ("::1", 0)
    for bad in ("nohost", ":80", "h:port", "h:70000"):
        with pytest.raises(ConfigError, match="--up"):
            parse_hostport(bad, option="--up")


def test_command_line_serves_until_sigterm(echo: _Server) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollpatch.netem",
            "--upstream",
            f"{echo.address[0]}:{echo.address[1]}",
            "--latency-ms",
            "5",
            "--mbps",
            "100",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+) ->", line)
        assert m, line
        with socket.create_connection(("127.0.0.1", int(m.group(1))), timeout=30) as s:
            s.sendall(b"ping")
            assert _recv_exactly(s, 4) == b"ping"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "stopped after 1 connection(s), 4 bytes up, 4 bytes down" in out


def test_command_line_refuses_a_bad_address() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rollpatch.netem", "--upstream", "nowhere"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--upstream must be HOST:PORT" in proc.stderr
