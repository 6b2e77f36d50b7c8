"""bench/sidecar.py's load generator: closed-loop completions from a subprocess.

Why not httpx: its AsyncClient cost about 9 ms of client CPU per streamed request, so on the
2-core machine the load generator competed with the sidecar and the engine and the ratios
measured the client. This one sends on rollpatch's own pooled keep-alive client (the one the
sidecar reaches its engine with, :class:`~rollpatch.serving.upstream.Upstream`) on uvloop,
and reports its own CPU per request (``client_cpu_per_req``).

Run as ``python bench/_sidecar_load.py JOB`` (JSON): ``url``, ``c`` in flight, ``n`` requests
(None: until stdin closes), optionally ``duration_s`` (no request starts after that many
seconds of the measured phase; those in flight finish), ``warmup``, ``bodies``, ``stream`` (SSE; the last data chunk
carries the labels, ``stream_options.include_usage`` the token count), ``token_times`` (keep,
per streamed request, the ``time.monotonic()`` at which each chunk with text arrived: the
system-wide clock, so another process can lay its own events over them). Prints the result.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from _util import log

from rollpatch.serving.upstream import Upstream, UpstreamError

MAX_TOKENS = 8
TIMEOUT_S = 600.0
_JSON = ((b"content-type", b"application/json"),)
PROMPTS = [
    f"What is {a} + {b}?"
    for a, b in ((12, 7), (305, 18), (4, 990), (77, 77), (123, 456), (8, 1), (640, 64), (99, 2))
]


class BenchError(SystemExit):
    """A response, a commit or a replica is not what it must be."""


async def _streamed(
    pool: Upstream, req: bytes, times: list[float] | None = None
) -> tuple[int, Any]:
    """One SSE completion, reassembled: text of every chunk, labels and usage of the last;
    ``times``: gets the arrival time of each chunk with text (every event of one read shares
    the read's time, as a client sees them)."""
    text, last = [], None
    resp = await pool.request("POST", "/v1/completions", req, _JSON)
    try:
        if resp.status != 200:
            return resp.status, (await resp.read()).decode(errors="replace")
        rest = b""
        while piece := await resp.piece():
            now = time.monotonic()
            lines = (rest + piece).split(b"\n")
            rest = lines.pop()  # an incomplete line waits for the next piece
            for line in lines:
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                last = json.loads(line[5:])
                got = [c.get("text", "") for c in last.get("choices") or []]
                text += got
                if times is not None and any(got):
                    times.append(now)
    finally:
        resp.close()
    body = dict(last or {})
    body["choices"] = [{"text": "".join(text)}]
    return 200, body


async def _once(pool: Upstream, req: bytes) -> tuple[int, Any]:
    resp = await pool.request("POST", "/v1/completions", req, _JSON)
    try:
        raw = await resp.read()
    finally:
        resp.close()
    return resp.status, (json.loads(raw) if resp.status == 200 else raw.decode(errors="replace"))


async def _drive(job: dict[str, Any], stop: threading.Event) -> dict[str, Any]:
    """Send ``job["n"]`` requests (or until ``stop``) with ``job["c"]`` in flight."""
    c, n, bodies = job["c"], job.get("n"), job["bodies"]
    payloads = [json.dumps(b, separators=(",", ":")).encode() for b in bodies]
    out: dict[str, Any] = {
        "lat": [],
        "start": [],  # of each request in "lat", seconds into the measured phase
        "errors": [],
        "texts": {},
        "labels": {},
        "bad_tokens": 0,
        "token_times": [],  # per recorded streamed request (job["token_times"])
    }
    began = [time.perf_counter()]
    pool = Upstream(job["url"], connect_s=30.0, max_connections=c, keepalive_expiry_s=60.0)

    async def one(i: int, record: bool) -> None:
        t0 = time.perf_counter()
        req = bodies[i % len(bodies)]
        times: list[float] | None = [] if job.get("token_times") else None
        try:
            async with asyncio.timeout(TIMEOUT_S):
                if req.get("stream"):
                    status, body = await _streamed(pool, payloads[i % len(bodies)], times)
                else:
                    status, body = await _once(pool, payloads[i % len(bodies)])
        except (UpstreamError, TimeoutError, ValueError) as e:  # counted; the parent decides
            out["errors"].append(f"{type(e).__name__} after {time.perf_counter() - t0:.3f} s: {e}")
            return
        dt = time.perf_counter() - t0
        if status != 200:
            out["errors"].append(f"{status}: {str(body)[:200]}")
            return
        if not record:
            return
        out["lat"].append(dt)
        out["start"].append(t0 - began[0])
        out["texts"].setdefault(str(i % len(bodies)), []).append(body["choices"][0]["text"])
        rp = body.get("rollpatch") or {}
        key = f"{rp.get('version_start')}-{rp.get('version_end')}"
        out["labels"][key] = out["labels"].get(key, 0) + 1
        out["bad_tokens"] += body["usage"]["completion_tokens"] != req["max_tokens"]
        if times is not None:
            out["token_times"].append(times)

    async def worker(
        counter: list[int], total: int | None, record: bool, until: float | None = None
    ) -> None:
        while not stop.is_set() and (total is None or counter[0] < total):
            if until is not None and time.perf_counter() >= until:
                return
            counter[0] += 1
            await one(counter[0], record)

    try:
        warm = [0]
        await asyncio.gather(*(worker(warm, job.get("warmup", 0), False) for _ in range(c)))
        sent = [0]
        t0, cpu0 = time.perf_counter(), time.process_time()
        began[0] = t0
        duration = job.get("duration_s")
        until = None if duration is None else t0 + duration
        await asyncio.gather(*(worker(sent, n, True, until) for _ in range(c)))
        out["wall"] = time.perf_counter() - t0
        # the load generator's own CPU per measured request: it shares the cores with the
        # sidecar and the engine, so the report shows it is far from the bottleneck
        out["client_cpu_per_req"] = (time.process_time() - cpu0) / max(1, sent[0])
    finally:
        await pool.aclose()
    out["texts"] = {k: sorted(set(v)) for k, v in out["texts"].items()}
    return out


def _run(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """On uvloop (a declared dependency of the web extra, as the sidecar serves on it)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def load_worker_main(job_json: str) -> int:
    """``--load-worker JOB``: drive the load, print the result as JSON on stdout. A job
    without ``n`` or ``duration_s`` runs until stdin closes (background load)."""
    job = json.loads(job_json)
    stop = threading.Event()
    if job.get("n") is None and job.get("duration_s") is None:

        def watch() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
    result = json.dumps(_run(_drive(job, stop)))
    if job.get("out"):  # a file, not the pipe (_result)
        Path(job["out"]).write_text(result)
    else:
        sys.stdout.write(result)
    return 0


def bodies(
    model: str = "model", stream: bool = False, max_tokens: int = MAX_TOKENS
) -> list[dict[str, Any]]:
    extra: dict[str, Any] = (
        {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    )
    return [
        {
            "model": model,
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
        for p in PROMPTS
    ]


def _worker_cmd(job: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), json.dumps(job)]


def check_errors(what: str, out: dict[str, Any]) -> None:
    """Wrong answers abort; failed requests are reported, and abort above 1%."""
    n_err = len(out["errors"])
    if not out["lat"]:
        raise BenchError(f"{what}: no request completed: {out['errors'][:3]}")
    if out["bad_tokens"] or n_err > 0.01 * (n_err + len(out["lat"])):
        raise BenchError(
            f"{what}: {n_err} failed requests, {out['bad_tokens']} with another number of "
            f"tokens than max_tokens: {out['errors'][:3]}"
        )
    if n_err:
        log(f"{what}: {n_err} failed request(s): {out['errors'][:3]}")


def run_load(
    url: str,
    c: int,
    n: int | None,
    warmup: int,
    body: list[dict[str, Any]] | None = None,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """A bounded load from a fresh subprocess: ``n`` requests, or as many as start within
    ``duration_s`` seconds (at least one of the two)."""
    if n is None and duration_s is None:
        raise ValueError("run_load: n or duration_s")
    job = {"url": url, "c": c, "n": n, "warmup": warmup, "bodies": body or bodies()}
    if duration_s is not None:
        job["duration_s"] = duration_s
    with tempfile.TemporaryDirectory(prefix="rp-load-") as tmp:
        job["out"] = str(Path(tmp) / "result.json")
        done = subprocess.run(_worker_cmd(job), capture_output=True, text=True, check=False)
        out = _result(job, done.returncode, done.stderr, "load worker")
    check_errors(f"{url} c={c}", out)
    return out


class BackgroundLoad:
    """``c`` requests kept in flight against ``url`` until :meth:`stop` (``body``: the
    request bodies, default :func:`bodies`; ``token_times``: see the module docstring)."""

    def __init__(
        self,
        url: str,
        c: int,
        body: list[dict[str, Any]] | None = None,
        *,
        token_times: bool = False,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="rp-load-")
        self.job = {"url": url, "c": c, "n": None, "warmup": 0, "bodies": body or bodies()}
        self.job["token_times"] = token_times
        self.job["out"] = str(Path(self._tmp.name) / "result.json")
        self.proc = subprocess.Popen(
            _worker_cmd(self.job),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> dict[str, Any]:
        with self._tmp:
            _, stderr = self.proc.communicate(input="", timeout=600)
            return _result(self.job, self.proc.returncode, stderr, "background load")


def _result(job: dict[str, Any], rc: int, stderr: str, what: str) -> dict[str, Any]:
    """A finished worker's result, from the file it wrote (not stdout: a CI run once got
    only the first 64 KiB of a ~600 KB result through the pipe)."""
    if rc != 0:
        raise BenchError(f"{what} failed: {stderr[-2000:]}")
    out: dict[str, Any] = json.loads(Path(job["out"]).read_text())
    return out


if __name__ == "__main__":
    sys.exit(load_worker_main(sys.argv[1]))
