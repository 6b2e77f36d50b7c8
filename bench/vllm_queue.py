"""A ``keep`` commit's hold in vLLM against the length of its waiting queue.

Run: ``python bench/vllm_queue.py [--queue 0,200,800] [--reps 3] [--json PATH]``.

Why: with ``VllmEngine(kv_on_commit="keep")`` no request admitted after a commit may reach a
block hashed from the old root, so every request still waiting must be hashed again from the
new one (docs/vllm.md, *KV of requests in flight*). An RL rollout queues whole batches at
once (e.g. 1,024 prompts x 8 samples), so the waiting queue can hold thousands of requests of
hundreds of tokens each. This bench measures what that queue costs the commit's hold.

How: vLLM (the engine-core hook, ``--max-num-seqs 2``) serves a small model; before each
commit the bench streams ``q + 2`` requests of ``--prompt-tokens`` random token ids each (two
run, ``q`` wait: the engine core's own counts are read before the commit, and must reach 90%
of ``q``, since the running ones finish while the queue fills), then the follower
syncs one version (staged in the worker, committed in keep mode), then the requests are
cancelled (vLLM aborts them) and the queue drains before the next commit. Queue lengths are
taken in a rotated order each round, so a slow spell of the shared machine falls on all.
*hold* is the engine core's own measure of the commit call (``core_ms``: generation held),
*pause* the commit gate's (HTTP and process hops included).

Every commit is checked: the engine holds the published digest after it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _util import log, machine, machine_line, table
from _vllm_reference import follower, sync_to
from _vllm_server import BenchError, Server, vllm_python
from _vllm_world import VOCAB, World, model_dims

from rollpatch.engines.vllm.core import SCHEDULER

#: Requests running beside the queue (vLLM's ``--max-num-seqs``).
RUNNING = 2


def counts(url: str) -> dict[str, float]:
    """The engine core's running and waiting requests now, as the hook reads them in the core
    (``rollpatch_scheduler``, no worker call; vLLM's ``/metrics`` gauges are updated on their
    own cadence: a poll of them missed two requests that ran for seconds)."""
    body = {"method": SCHEDULER, "timeout": 60}
    r = httpx.post(f"{url}/collective_rpc", json=body, timeout=60)
    r.raise_for_status()
    state = r.json()["results"][0]
    if not isinstance(state, dict) or "waiting" not in state:
        raise BenchError("the server reports no scheduler counts: start it with the hook")
    return {"waiting": float(state["waiting"]), "running": float(state["running"])}


def wait_for(
    url: str, total: int, flood: Flood | None = None, timeout: float = 180.0
) -> dict[str, float]:
    """Poll :func:`counts` until ``total`` requests are in the engine core, one of them
    running (the next step admits the rest up to ``--max-num-seqs``; a poll goes through the
    engine core between steps and takes up to seconds while it generates), or with ``total``
    0 until none is; a request of ``flood`` failing or ending first ends the wait."""
    t0 = time.monotonic()
    while True:
        bad = flood.failures() if flood is not None else []
        if bad:
            raise BenchError(f"{len(bad)} queued requests failed, e.g. {bad[0]}")
        if flood is not None and flood.tasks and all(t.done() for t in flood.tasks):
            raise BenchError(f"all {len(flood.tasks)} requests ended before the queue was seen")
        g = counts(url)
        inside = g["waiting"] + g["running"]
        if (inside == 0) if total == 0 else (g["running"] >= 1 and inside >= total):
            return g
        if time.monotonic() - t0 > timeout:
            raise BenchError(f"vLLM did not hold {total} requests in {timeout} s: {g}")
        time.sleep(0.1)


class Flood:
    """Streamed completions on an event loop of their own thread, cancelled together."""

    def __init__(self, url: str, model: str, gen_tokens: int) -> None:
        self.url, self.model, self.gen_tokens = url, model, gen_tokens
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tasks: list[asyncio.Task[None]] = []
        self.client: httpx.AsyncClient | None = None

    async def _one(self, prompt: list[int]) -> None:
        assert self.client is not None
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.gen_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise BenchError(f"{r.status_code}: {(await r.aread())[:300]!r}")
            events = 0
            last = ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events, last = events + 1, line
            if events < self.gen_tokens:  # vLLM ended it early: say how
                raise BenchError(f"a stream ended after {events} tokens: {last[:300]}")

    async def _start(self, prompts: list[list[int]]) -> None:
        limits = httpx.Limits(max_connections=len(prompts) + 8)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits)
        self.tasks = [asyncio.ensure_future(self._one(p)) for p in prompts]

    async def _stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()
        self.tasks, self.client = [], None

    def failures(self) -> list[str]:
        """The requests that ended with an error (a refusal, a dropped connection)."""
        return [
            repr(t.exception())
            for t in self.tasks
            if t.done() and not t.cancelled() and t.exception() is not None
        ]

    def start(self, prompts: list[list[int]]) -> None:
        asyncio.run_coroutine_threadsafe(self._start(prompts), self.loop).result(60)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(120)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    queues = [int(x) for x in args.queue.split(",")]
    versions = 1 + len(queues) * args.reps  # v1: a warm-up commit, not timed
    rng = np.random.default_rng(0)
    from rollpatch.engines.vllm import VllmEngine

    with tempfile.TemporaryDirectory(prefix="rp-bench-vllm-queue-") as tmp:
        root = Path(tmp)
        log(f"building the model and publishing v0..v{versions}")
        world = World(root, args.lr, versions, model_dims(args.hidden, args.layers))
        log("starting vLLM on v0's checkpoint")
        extra = [
            "--max-num-seqs",
            str(RUNNING),
            "--max-model-len",
            str(args.prompt_tokens + args.gen_tokens + 16),
        ]
        server = Server(vllm_python(), world.checkpoint(0), root / "vllm.log", extra=extra)
        engine = None
        flood = Flood(server.url, str(server.model), args.gen_tokens)
        samples: list[dict[str, Any]] = []
        try:
            server.wait_ready()
            engine = VllmEngine(server.url, kv_on_commit="keep")
            engine.http.post(
                "/v1/completions",
                {"model": str(server.model), "prompt": "warm", "max_tokens": 2},
                timeout=600,
            )
            engine.adopt(0, world.digests[0])
            f = follower(world, engine)
            sync_to(f, world, 1)  # warm-up: the first commit sets up the hook's path
            v = 1
            for r in range(args.reps):
                for q in queues[r % len(queues) :] + queues[: r % len(queues)]:
                    v += 1
                    n = q + RUNNING
                    prompts = rng.integers(16, VOCAB - 16, size=(n, args.prompt_tokens)).tolist()
                    flood.start(prompts)
                    # the queue also drains while it fills (the running requests end): 90%
                    g = wait_for(server.url, q * 9 // 10 + RUNNING, flood)
                    waiting = max(0.0, g["waiting"] + g["running"] - RUNNING)
                    rec = sync_to(f, world, v)
                    flood.stop()
                    wait_for(server.url, 0)
                    if engine.kv.applied != "keep":  # type: ignore[attr-defined]
                        raise BenchError(f"v{v}: the commit did not keep the KV")
                    hold = float(rec["phases_ms"].get("core_ms", float("nan")))
                    samples.append(
                        {
                            "queue": q,
                            "waiting": waiting,
                            "hold_ms": hold,
                            "pause_s": rec["pause_s"],
                            "load": rec["load"],
                        }
                    )
                    log(
                        f"  v{v}: {waiting:.0f} waiting, hold {hold:.1f} ms, "
                        f"pause {rec['pause_s'] * 1e3:.1f} ms"
                    )
        except Exception:
            log_lines = server.log_path.read_text(errors="replace").splitlines()
            sys.stderr.write("\n".join([x for x in log_lines if "/metrics" not in x][-40:]) + "\n")
            raise
        finally:
            flood.close()
            if engine is not None:
                engine.close()
            server.stop()
    return {"args": vars(args), "samples": samples}


def report(out: dict[str, Any], mach: dict[str, Any]) -> str:
    a = out["args"]
    rows = []
    for q in [int(x) for x in a["queue"].split(",")]:
        s = [x for x in out["samples"] if x["queue"] == q]
        hold = [x["hold_ms"] for x in s]
        pause = [x["pause_s"] * 1e3 for x in s]
        rows.append(
            [
                str(q),
                f"{statistics.median(x['waiting'] for x in s):.0f}",
                str(len(s)),
                f"{statistics.median(hold):.1f}",
                f"{max(hold):.1f}",
                f"{statistics.median(pause):.1f}",
                f"{max(pause):.1f}",
            ]
        )
    head = (
        f"vLLM keep commits against the waiting queue: {a['hidden']}x{a['layers']} model, "
        f"prompts of {a['prompt_tokens']} tokens, {RUNNING} running\n{machine_line(mach)}"
    )
    cols = ["queue", "waiting p50", "n", "hold p50", "hold max", "pause p50", "pause max"]
    return (
        head
        + "\n"
        + table(cols, rows)
        + (
            "\nwaiting: requests in the engine core beyond the running slots just before the "
            "commit; hold: the engine core's commit call (generation held), ms; pause: the "
            "commit gate's, ms"
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--queue", default="0,200,800", help="waiting requests at each commit")
    ap.add_argument("--reps", type=int, default=3, help="commits per queue length")
    ap.add_argument("--prompt-tokens", type=int, default=448, help="tokens per queued prompt")
    ap.add_argument(
        "--gen-tokens",
        type=int,
        default=1024,
        help="tokens asked of each (the running ones must outlast the wait for the queue)",
    )
    ap.add_argument("--hidden", type=int, default=512, help="model width")
    ap.add_argument("--layers", type=int, default=4, help="model depth")
    ap.add_argument("--lr", type=float, default=5e-6, help="AdamW learning rate")
    ap.add_argument("--json", type=Path, default=None, help="also write every sample here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    mach = machine()
    t0 = time.perf_counter()
    out = run(args)
    out["machine"], out["wall_s"], out["load_end"] = mach, time.perf_counter() - t0, os.getloadavg()
    print(report(out, mach), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
