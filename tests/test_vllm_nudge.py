"""The nudges sent to vLLM's API server while a call is in flight (rollpatch.engines.vllm.nudge,
and ``Http(nudge=...)``), against a real HTTP server on a socket."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from rollpatch.engines.vllm.client import Http
from rollpatch.engines.vllm.nudge import Nudger


def test_a_short_call_is_not_nudged_and_a_long_one_is_from_another_thread() -> None:
    """No nudge for a call that ends within the period (a long period here, so a loaded host
    cannot make the call outlast it); several, from the nudger's thread, for a call that lasts
    many periods, and none once it has ended."""
    quiet = Nudger(lambda: None, period_s=5.0)
    try:
        with quiet.watch():
            pass
        time.sleep(0.1)
        assert quiet.sent == 0
    finally:
        quiet.close()
    seen: list[str] = []
    n = Nudger(lambda: seen.append(threading.current_thread().name), period_s=0.05)
    try:
        t0 = time.monotonic()
        with n.watch():
            time.sleep(0.6)  # about 11 periods: the first after one period, then one per period
        lasted = time.monotonic() - t0  # a loaded host oversleeps
        time.sleep(0.5)  # a nudge under way when the call ended has finished
        sent = n.sent
        assert 3 <= sent <= lasted / 0.05 + 2, (sent, lasted)
        assert set(seen) == {"rollpatch-vllm-nudge"}
        time.sleep(0.3)
        assert n.sent == sent, "nudges went on after the call ended"
    finally:
        n.close()


def test_failing_nudges_are_ignored_and_close_stops_the_thread() -> None:
    calls = []

    def boom() -> None:
        calls.append(1)
        raise OSError("the server is gone")

    n = Nudger(boom, period_s=0.02)
    with n.watch():  # failing nudges go on (CI's load once gave none in a fixed 0.2 s)
        deadline = time.monotonic() + 30
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    n.close()  # joins the thread: the counts are final
    assert len(calls) >= 2 and n.sent == len(calls)
    with n.watch():  # after close: no thread, no nudge
        time.sleep(0.1)
    assert n.sent == len(calls)
    with pytest.raises(ValueError):
        Nudger(lambda: None, period_s=0)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    hits: dict[str, int]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        self.server.hits[self.path] = self.server.hits.get(self.path, 0) + 1
        if self.path == "/slow":
            time.sleep(0.5)
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = _answer
    do_POST = _answer


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.hits = {}
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_http_nudges_its_server_while_a_request_is_slow(server: _Server) -> None:
    """A request answered within the period sends no nudge (a long period here, so a loaded
    host cannot make it outlast it); one answered after 0.5 s is nudged (every 50 ms at most),
    on the nudges' own connection, and its own answer is unchanged."""
    url = f"http://127.0.0.1:{server.server_address[1]}"
    quick = Http(url, 10.0, nudge="/nudge", nudge_s=5.0)
    assert quick.nudger is not None
    try:
        assert quick.post("/fast") == {"ok": True}
        time.sleep(0.1)
        assert server.hits.get("/nudge", 0) == 0
    finally:
        quick.nudger.close()
    h = Http(url, 10.0, nudge="/nudge", nudge_s=0.05)
    assert h.nudger is not None
    try:
        t0 = time.monotonic()
        assert h.post("/slow") == {"ok": True}
        lasted = time.monotonic() - t0
    finally:
        h.nudger.close()  # joins the thread: a nudge under way has reached the server
    assert server.hits["/slow"] == 1
    # at least one nudge (each waits for its own answer, which a loaded host can slow), at
    # most one per period of the request's measured length
    assert 1 <= server.hits.get("/nudge", 0) <= lasted / 0.05 + 2, (server.hits, lasted)
    plain = Http(url, 10.0)
    assert plain.nudger is None and plain.get("/fast") == {"ok": True}


def test_the_nudge_period_setting() -> None:
    """``ROLLPATCH_VLLM_NUDGE_MS``: unset or empty gives the default, 0 turns nudges off, and
    anything but a whole number of milliseconds >= 0 is refused with a clear error."""
    from rollpatch.engines.vllm import nudge
    from rollpatch.errors import ConfigError

    assert nudge.period_s({}) == nudge.period_s({nudge.ENV: " "}) == nudge.DEFAULT_MS / 1e3
    assert nudge.period_s({nudge.ENV: "20"}) == 0.02
    assert nudge.period_s({nudge.ENV: "0"}) is None
    for bad in ("-1", "5ms", "0.5"):
        with pytest.raises(ConfigError, match=nudge.ENV):
            nudge.period_s({nudge.ENV: bad})
