"""The relay's shutdown drain (``rollpatch relay --shutdown-grace``, relay/drain.py): new reads
get 503 (the follower's relay client retries them), ``/health`` says draining, held long-polls
answer at once, and a body in flight is sent to its last byte; the CLI does it on SIGTERM.

The relays are real uvicorn servers on loopback; bodies large enough (32 MB, sent in 64 KiB
chunks) that the server is still sending when the drain starts, since the test reads the first
chunk only.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import httpx
import pytest

from rollpatch.board import Board
from rollpatch.errors import TransientStoreError
from rollpatch.store import open_store
from tests.conftest import free_port, until
from tests.relayfix import RUN, board, publish, serve
from tests.relayworld import World, client_of, held_in_thread, version_of, waiting, world

_FIXTURES = (board, serve, world)  # used by name
BIG = 32 << 20
CHUNK = 64 << 10


def _started_body(
    url: str, key: str
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A GET of ``key`` whose first chunk has been read: the server is still sending."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=30)
    conn.request("GET", f"/v1/objects/{key}")
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def test_drain_refuses_new_reads_and_finishes_the_body_in_flight(board: Board, serve) -> None:
    data = os.urandom(BIG)
    key = board.put_object(RUN, data, "safetensors").key
    small = publish(board, 0, keyframe=True)[0].key
    relay = serve(board.store, chunk_bytes=CHUNK)
    assert open_store(relay.url, retries=0).get(small)  # cached before the drain
    conn, r = _started_body(relay.url, key)
    try:
        head = r.read(CHUNK)
        until(lambda: relay.inflight() == 1, "the body to be in flight")
        done: list[bool] = []
        drainer = threading.Thread(target=lambda: done.append(relay.drain(30.0)))
        drainer.start()
        until(lambda: relay.draining.draining, "the drain to start")
        refused = httpx.get(f"{relay.url}/v1/objects/{small}")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "relay is shutting down" in refused.json()["error"]["message"]
        health = httpx.get(f"{relay.url}/health")
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert httpx.get(f"{relay.url}/metrics").status_code == 200  # scrapes go on
        with pytest.raises(TransientStoreError, match="shutting down"):
            open_store(relay.url, retries=0).get(small)  # a follower's client retries a 503
        assert drainer.is_alive() and relay.inflight() == 1
        body = head + r.read()
    finally:
        conn.close()
    assert body == data  # the read in flight got every byte
    drainer.join(30)
    assert done == [True] and relay.inflight() == 0
    counted = 'rollpatch_relay_requests_total{method="GET",route="objects",status="503"} 2'
    assert counted in relay.relay.metrics.render().splitlines()  # both refused reads


def test_drain_answers_held_long_polls_at_once(world: World) -> None:
    c = client_of(world.origin.url)
    t, out = held_in_thread(c, 0, 60.0)
    until(lambda: waiting(world.origin) == 1, "the long-poll to be held")
    assert world.origin.drain(30.0)  # no read left in flight: the held one answered
    t.join(10)
    assert not t.is_alive() and version_of(out[0]) == 0


def test_cli_drains_on_sigterm(tmp_path: Path) -> None:
    root = tmp_path / "board"
    data = os.urandom(BIG)
    key = Board(f"file://{root}").put_object(RUN, data, "safetensors").key
    port = free_port()
    cmd = [sys.executable, "-m", "rollpatch", "relay", "--board", f"file://{root}"]
    cmd += ["--port", str(port), "--cache", str(tmp_path / "cache"), "--cache-bytes", "128M"]
    cmd += ["--chunk-bytes", str(CHUNK), "--shutdown-grace", "60"]
    cmd += ["--log-level", "info", "--log-format", "json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: _up(url, proc), "the relay to listen", timeout=30)
        conn, r = _started_body(url, key)
        head = r.read(CHUNK)
        proc.send_signal(signal.SIGTERM)
        until(lambda: httpx.get(f"{url}/health").status_code == 503, "the drain to start")
        assert httpx.get(f"{url}/v1/objects/{key}").status_code == 503
        assert proc.poll() is None  # still sending the body in flight
        body = head + r.read()
        conn.close()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert body == data
    assert proc.returncode == 0, out
    assert "rollpatch relay: draining 1 request(s) in flight" in out, out
    assert "stopping with" not in out, out
    events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    said = [(e["event"], e.get("inflight")) for e in events if e["service"] == "relay"]
    assert ("draining", 1) in said and ("stopping", None) in said, said  # in the log too
    assert not any(e["event"] == "drain_cut_short" for e in events)


def _up(url: str, proc: subprocess.Popen[str]) -> bool:
    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
