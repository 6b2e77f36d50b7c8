"""The sidecar's CPU per streamed request in front of a fake engine, two relays side by side.

``python bench/_sidecar_fake.py [--gaps 1,5] [--levels 1:200,16:800] [--rounds 2]``

Why a fake engine: in front of a real one the sidecar's CPU per request moves with the
engine's speed (each event that arrives alone wakes the sidecar), by more than a change of the
sidecar itself (docs/sidecar.md). Here a process streams what vLLM streams for an 8-token
completion with ``include_usage`` (8 token events, the usage event, ``[DONE]``; chunked) with
a fixed gap between events, costing next to nothing; two sidecar processes stand in front of
it, one relaying streams in the engine connection's protocol (``tap``,
:mod:`rollpatch.sidecar.relay`) and one in the request's task (``task``, the relay before),
and the same closed-loop load (``bench/_sidecar_load.py``, its own process) goes through each
in turn, in chunks ordered (task, tap, tap, task) x rounds in one run, so drift in the
machine's load hits both alike. Per chunk: the CPU seconds (user + system, ``/proc``) the
sidecar process spent, divided by the requests; the table shows the median over chunks and,
in brackets, the range. The load checks every answer (200, 8 tokens, labelled v0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _sidecar_engine import cpu_s
from _sidecar_load import BenchError, bodies, run_load
from _sidecar_proc import SidecarProcess

RUN = "fake"


def _event(obj: dict[str, Any]) -> bytes:
    data = b"data: " + json.dumps(obj, separators=(", ", ": ")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


def _chunk(i: int) -> dict[str, Any]:
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 1,
        "model": "model",
        "choices": [{"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}],
        "usage": None,
    }


USAGE = {
    "id": "cmpl-fake",
    "object": "text_completion",
    "created": 1,
    "model": "model",
    "choices": [],
    "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
}
HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


class _Fake(asyncio.Protocol):
    """A keep-alive HTTP/1.1 server of one kind of answer (requests are small and whole)."""

    def __init__(self, gap_s: float, digest: str) -> None:
        self.gap_s, self.digest = gap_s, digest
        self.buf = b""

    def connection_made(self, transport: Any) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        i = head.find(b"content-length:")
        length = int(head[i + 15 :].split(b"\r\n", 1)[0]) if i >= 0 else 0
        if len(self.buf) < end + 4 + length:
            return
        self.buf = self.buf[end + 4 + length :]
        if head.startswith(b"get /rollpatch/state"):
            self._json({"version": 0, "digest": self.digest})
        elif head.startswith(b"get"):
            self._json({"status": "ok"})
        else:
            asyncio.ensure_future(self._stream())

    def _json(self, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode()
        self.t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(body), body)
        )

    async def _stream(self) -> None:
        self.t.write(HEAD)
        for i in range(8):
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
            self.t.write(_event(_chunk(i)))
        if self.gap_s:
            await asyncio.sleep(self.gap_s)
        self.t.write(_event(USAGE) + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


def engine_main(gap_ms: float, digest: str) -> int:
    """``--engine GAP_MS DIGEST``: serve on a free port, print the URL, serve until stdin
    closes."""
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(lambda: _Fake(gap_ms / 1e3, digest), "127.0.0.1", 0)
        print(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", flush=True)
        await loop.run_in_executor(None, sys.stdin.read)
        srv.close()

    uvloop.run(serve())
    return 0


def _board(root: Path) -> tuple[str, str]:
    """A board with v0 of a small view; (board URL, v0 digest)."""
    import numpy as np

    from rollpatch.formats import cast_view
    from rollpatch.publisher import Publisher, PublisherConfig

    rng = np.random.default_rng(0)
    masters = {f"w{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in range(4)}
    url = f"file://{root / 'board'}"
    Publisher(url, RUN, PublisherConfig(keyframe_every=0), asynchronous=False).publish(masters)
    return url, cast_view(masters, "bf16").digest()


def measure(gap_ms: float, levels: list[tuple[int, int]], rounds: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="rp-bench-fake-") as tmp:
        board, digest = _board(Path(tmp))
        eng = subprocess.Popen(
            [sys.executable, __file__, "--engine", str(gap_ms), digest],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert eng.stdout is not None and eng.stdin is not None
        url = eng.stdout.readline().strip()
        job = {"board": board, "run": RUN, "kind": "reference", "url": url, "digest": digest}
        procs = {v: SidecarProcess({**job, "tap": v == "tap"}) for v in ("task", "tap")}
        rows = []
        try:
            body = bodies(stream=True)
            for p in procs.values():
                run_load(p.url, 2, 16, 0, body)
            for c, n in levels:
                got: dict[str, list[float]] = {"task": [], "tap": []}
                for v in ("task", "tap", "tap", "task") * rounds:
                    cpu0 = cpu_s(procs[v].pid)
                    r = run_load(procs[v].url, c, n, min(c, 8), body)
                    if set(r["labels"]) != {"0-0"}:
                        raise BenchError(f"labels {r['labels']} != v0")
                    got[v].append((cpu_s(procs[v].pid) - cpu0) / (len(r["lat"]) + min(c, 8)))
                rows.append({"gap_ms": gap_ms, "c": c, "n": n, **got})
                print(_row(rows[-1]), flush=True)
        finally:
            for p in procs.values():
                p.stop()
            eng.stdin.close()
            eng.wait(30)
    return rows


def _row(r: dict[str, Any]) -> str:
    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.2f} ms ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})"

    ratio = statistics.median(r["tap"]) / statistics.median(r["task"])
    return (
        f"| {r['gap_ms']:g} ms | {r['c']} | {cell(r['task'])} | {cell(r['tap'])} | "
        f"{ratio:.2f} | {os.getloadavg()[0]:.1f} |"
    )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        return engine_main(float(sys.argv[2]), sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gaps", default="1,5", help="ms between events, comma-separated")
    ap.add_argument("--levels", default="1:200,16:800", help="c:n pairs, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    levels = [(int(c), int(n)) for c, n in (x.split(":") for x in args.levels.split(","))]
    print("| gap | c | task relay CPU/req | tap relay CPU/req | tap/task | load |")
    print("|---|---|---|---|---|---|")
    for gap in (float(g) for g in args.gaps.split(",")):
        measure(gap, levels, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
