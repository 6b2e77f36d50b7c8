"""bench/sidecar.py's proxy part: the chunk order, the per-pair statistics and the targets
table built from them, and the load generator's time-bounded chunks against a live HTTP server
(no engine needed)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _sidecar_load import BenchError, bodies, run_load
from _sidecar_proxy import (
    TARGET_P50_ADDED_S,
    TARGET_RATIO,
    _check_texts,
    _row,
    chunk_order,
    pair_stats,
)
from _sidecar_proxy_report import target_rows


def test_chunk_order_alternates_pairs() -> None:
    order = chunk_order(4)
    assert len(order) == 8
    pairs = [order[i : i + 2] for i in range(0, 8, 2)]
    assert all(sorted(p) == ["direct", "sidecar"] for p in pairs)
    # each pair starts with the path the previous pair ended with: drift hits both alike
    assert all(pairs[i][0] == pairs[i - 1][1] for i in range(1, 4))
    assert chunk_order(1) == ["direct", "sidecar"]


def _chunk(target: str, rps: float, p50: float) -> dict[str, Any]:
    wall = 5.0
    n = round(rps * wall)
    return {
        "target": target,
        "rps": n / wall,
        "p50": p50,
        "max": p50,
        "wall": wall,
        "cpu": 1e-3 if target == "sidecar" else 1e-4,
        "engine_cpu": 0.03,
        "client_cpu": 3e-4,
        "errors": [],
        "lat": [p50] * n,
        "start": [i / rps for i in range(n)],
    }


def test_check_texts_tells_a_proxy_that_changed_a_completion_from_engine_variance(
    capsys: pytest.CaptureFixture[str],
) -> None:
    same = {"0": {"4": {"direct once c=1", "sidecar once c=1"}}}
    _check_texts("vllm", same)
    changed = {"0": {"4": {"direct once c=1", "sidecar once c=1"}, "5": {"sidecar once c=16"}}}
    with pytest.raises(BenchError, match="prompt 0: the sidecar changed a completion"):
        _check_texts("vllm", changed)
    variant = {
        "0": {"4": {"direct once c=1", "sidecar once c=1"}, "5": {"direct once c=16"}},
        "1": {"x": {"direct stream c=1", "sidecar stream c=1"}},
    }
    _check_texts("vllm", variant)
    err = capsys.readouterr().err
    assert "prompt 0 got 2 completions at temperature 0, 2 on the direct path" in err
    assert "prompt 1" not in err


def test_pair_stats_and_targets_table() -> None:
    spec = [("direct", 100, 0.050), ("sidecar", 99, 0.0505), ("sidecar", 80, 0.052)]
    spec += [("direct", 100, 0.050), ("direct", 90, 0.060), ("sidecar", 92, 0.058)]
    chunks = [_chunk(*s) for s in spec]
    pairs = pair_stats(chunks)
    assert len(pairs) == 3
    for p, (d, s) in zip(
        pairs, [(chunks[0], chunks[1]), (chunks[3], chunks[2]), (chunks[4], chunks[5])], strict=True
    ):
        assert p["ratio"] == pytest.approx(s["rps"] / d["rps"])
        assert p["p50_added"] == pytest.approx(s["p50"] - d["p50"])
        met = p["ratio"] >= TARGET_RATIO and p["p50_added"] <= TARGET_P50_ADDED_S
        assert p["met"] == float(met)
    assert [p["met"] for p in pairs] == [1.0, 0.0, 1.0]  # 0.8x in the middle pair
    row = _row("reference", "once", 16, chunks)
    assert row["n"] == sum(len(c["lat"]) for c in chunks)
    d_n = sum(len(c["lat"]) for c in chunks if c["target"] == "direct")
    assert row["direct"]["rps"] == pytest.approx(d_n / 15.0)
    (cells,) = target_rows([row])
    ratios = sorted(p["ratio"] for p in pairs)
    assert cells[6] == f"{ratios[0]:.2f}..{ratios[-1]:.2f}"
    assert cells[-1] == "2/3"
    with pytest.raises(ValueError, match="pairs"):
        pair_stats([chunks[0], chunks[4]])


class _Server:
    """A keep-alive HTTP/1.1 server answering every request with one completion."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        body = json.dumps({"choices": [{"text": "x"}], "usage": {"completion_tokens": 8}}).encode()
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await r.readexactly(length)
                await asyncio.sleep(0.01)
                w.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%b" % (len(body), body)
                )
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server() -> Iterator[str]:
    s = _Server()
    try:
        yield f"http://127.0.0.1:{s.port}"
    finally:
        s.stop()


def test_run_load_time_bounded(server: str) -> None:
    duration = 0.6
    out = run_load(server, 4, None, 2, bodies(), duration_s=duration)
    assert out["lat"] and len(out["start"]) == len(out["lat"])
    assert max(out["start"]) < duration  # no request starts after the chunk's time
    assert out["wall"] >= duration
    # those in flight finish, nothing more: the run ends with its last request (a bound on
    # the requests' own ends, not on the clock, which a loaded CI box stretches: 2.2 s once)
    last_end = max(s + lat for s, lat in zip(out["start"], out["lat"], strict=True))
    assert out["wall"] - last_end < 0.5
    n = run_load(server, 2, 6, 0, bodies())
    assert len(n["lat"]) == 6  # a count-bounded chunk is unchanged


def test_run_load_needs_a_bound(server: str) -> None:
    with pytest.raises(ValueError, match="n or duration_s"):
        run_load(server, 1, None, 0)


def test_run_load_refuses_a_chunk_with_no_answer() -> None:
    # nothing listens on a port just released: every request fails, none completes
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BenchError, match="no request completed"):
        run_load(f"http://127.0.0.1:{port}", 1, None, 0, bodies(), duration_s=0.3)
