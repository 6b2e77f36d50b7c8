"""Sidecar benchmark: proxy overhead, engine pause per commit, and relay fan-out.

Run: ``python bench/sidecar.py`` (about 4 minutes on the 2-core development machine),
``python bench/sidecar.py --quick`` (about 1.3 minutes), ``--json out.json`` for every sample.

**Model.** One random BF16 Llama from :func:`make_tiny_model` (hidden 256, 4 layers, 4 heads /
2 kv heads, ff 688, vocab 2048: 4.0M parameters, a 7.9 MB served view) served by the built-in
reference engine (CPU, ``threads=1``) in this process, as ``rollpatch sidecar --engine
reference`` runs it. Every engine of the run loads the same directory.

**Versions.** FP32 masters start as the model's own weights (v0, the only keyframe). Each next
version is one AdamW step (betas 0.9/0.999, ``--lr`` 3e-6, weight decay 0.01) with the Adam
state warm (``m`` at its stationary spread, ``v = E[g^2]``) and gradients ``s_t(0.15 P + e)``:
a persistent direction ``P`` plus i.i.d. noise, ``s_t`` a per-tensor scale; published as
``bf16`` by a synchronous :class:`Publisher` (skip strides (8,)) to a ``file://`` board.

**1. Proxy overhead.** The same completions (8 short arithmetic prompts, ``max_tokens`` 8,
temperature 0, ``ignore_eos``: every request generates 8 tokens) sent at 1, 16 and 64 concurrent
requests (closed loop), to the engine's own URL (direct) and through the sidecar (drain mode,
follower polling a still board), in chunks ordered (direct, sidecar, sidecar, direct) x 2 rounds
(1 with ``--quick``) so drift in the machine's load hits both alike. The load generator is
``httpx.AsyncClient`` in a subprocess (this file, ``--load-worker``), so its CPU does not share
the servers' GIL; the servers' own CPU time per request (``time.process_time`` of this process
over a chunk) is reported too, as it does not depend on other jobs. Checked: every answer is
200 with 8 tokens and the same text for the same prompt on both paths, and the sidecar labels
it with the version it serves.

**2. Engine pause per commit.** For each commit mode a fresh engine + sidecar boots from the
board, then ``--versions`` versions are published one at a time, each waited for, under a
background load of 4 concurrent requests through the sidecar. Per commit: the gate's recorded
pause (``CommitGate.last_pause_s``: the weight write; in pause mode also the wait for the
forward pass in flight) and the follower's ``pause_s`` (in drain mode it adds the wait for
in-flight requests: how long admission stays closed). Baselines, after each mode, idle, on a
separate runtime of the same model: ``ReferenceRuntime.load_view`` of the full view already in
RAM (digests known: only the copy and the re-hash under the forward lock), the same after
reading and parsing the keyframe safetensors from the board (page cache warm), a cold
``ReferenceRuntime(model_dir)``, and, alternated with the RAM reload, the last step's patch
applied by ``ReferenceEngine.apply`` (the same swap, without server or load). Checked: every
commit's and every idle apply's engine digest equals the digest of ``cast_view(masters)``
computed here; in drain mode no response spans a commit.

**3. Relay fan-out.** 8 followers (each a :class:`Follower` on its own :class:`ViewEngine` and
its own board client) boot to v0 and then catch up to the last version, all at once, reading
the ``file://`` board directly or through a :class:`RelayServer` in front of it. Upstream
bytes are counted by one wrapper around the board's store (the same wrapper is the relay's
upstream), so both sides count the same reads. Checked: every follower's digest, recomputed
from its words, equals the publisher-side digest; the relay's own upstream-bytes metric agrees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _util import WarmAdamW, log, machine, machine_line, table

from rollpatch.board import Board
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import ObjectInfo, Store, open_store
from rollpatch.view import View, root_digest

RUN = "bench"
MODEL_DIMS = {"hidden_size": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 688}
MAX_TOKENS = 8
PROMPTS = [f"What is {a} + {b}?" for a, b in ((12, 7), (305, 18), (4, 990), (77, 77),
                                              (123, 456), (8, 1), (640, 64), (99, 2))]
BACKGROUND_CONCURRENCY = 4
FOLLOWERS = 8


class BenchError(SystemExit):
    """A response, a commit or a replica is not what it must be."""


# -- load generator (runs in a subprocess) -------------------------------------------------------

async def _drive(job: dict[str, Any], stop: threading.Event) -> dict[str, Any]:
    """Send ``job["n"]`` requests (or until ``stop``) with ``job["c"]`` in flight."""
    import httpx

    c, n, bodies = job["c"], job.get("n"), job["bodies"]
    out: dict[str, Any] = {"lat": [], "errors": [], "texts": {}, "labels": {}, "bad_tokens": 0}
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(base_url=job["url"], limits=limits,
                                 timeout=httpx.Timeout(600.0)) as client:
        async def one(i: int, record: bool) -> None:
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/completions", json=bodies[i % len(bodies)])
            except httpx.HTTPError as e:  # counted; the parent decides
                out["errors"].append(f"{type(e).__name__} after {time.perf_counter() - t0:.3f}"
                                     f" s: {e}")
                return
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                out["errors"].append(f"{r.status_code}: {r.text[:200]}")
                return
            body = r.json()
            if not record:
                return
            out["lat"].append(dt)
            out["texts"].setdefault(str(i % len(bodies)), []).append(body["choices"][0]["text"])
            rp = body.get("rollpatch") or {}
            key = f"{rp.get('version_start')}-{rp.get('version_end')}"
            out["labels"][key] = out["labels"].get(key, 0) + 1
            out["bad_tokens"] += body["usage"]["completion_tokens"] != MAX_TOKENS

        async def worker(counter: list[int], total: int | None, record: bool) -> None:
            while not stop.is_set() and (total is None or counter[0] < total):
                counter[0] += 1
                await one(counter[0], record)

        warm = [0]
        await asyncio.gather(*(worker(warm, job.get("warmup", 0), False) for _ in range(c)))
        sent = [0]
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(sent, n, True) for _ in range(c)))
        out["wall"] = time.perf_counter() - t0
    out["texts"] = {k: sorted(set(v)) for k, v in out["texts"].items()}
    return out


def load_worker_main(job_json: str) -> int:
    """``--load-worker JOB``: drive the load, print the result as JSON on stdout. A job
    without ``n`` runs until stdin closes (background load)."""
    job = json.loads(job_json)
    stop = threading.Event()
    if job.get("n") is None:
        def watch() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
    sys.stdout.write(json.dumps(asyncio.run(_drive(job, stop))))
    return 0


def _bodies() -> list[dict[str, Any]]:
    return [{"model": "model", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
             "ignore_eos": True} for p in PROMPTS]


def _worker_cmd(job: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--load-worker", json.dumps(job)]


def check_errors(what: str, out: dict[str, Any]) -> None:
    """Wrong answers abort; failed requests are reported, and abort above 1%."""
    n_err = len(out["errors"])
    if out["bad_tokens"] or n_err > 0.01 * (n_err + len(out["lat"])):
        raise BenchError(f"{what}: {n_err} failed requests, {out['bad_tokens']} with != "
                         f"{MAX_TOKENS} tokens: {out['errors'][:3]}")
    if n_err:
        log(f"{what}: {n_err} failed request(s): {out['errors'][:3]}")


def run_load(url: str, c: int, n: int, warmup: int) -> dict[str, Any]:
    """A bounded load from a fresh subprocess."""
    job = {"url": url, "c": c, "n": n, "warmup": warmup, "bodies": _bodies()}
    done = subprocess.run(_worker_cmd(job), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"load worker failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    check_errors(f"{url} c={c}", out)
    return out


class BackgroundLoad:
    """``c`` requests kept in flight against ``url`` until :meth:`stop`."""

    def __init__(self, url: str, c: int) -> None:
        job = {"url": url, "c": c, "n": None, "warmup": 0, "bodies": _bodies()}
        self.proc = subprocess.Popen(_worker_cmd(job), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self) -> dict[str, Any]:
        stdout, stderr = self.proc.communicate(input="", timeout=600)
        if self.proc.returncode != 0:
            raise BenchError(f"background load failed: {stderr[-2000:]}")
        return json.loads(stdout)


# -- the world: a model, its masters under AdamW, a board ---------------------------------------

class World:
    """The model directory, FP32 masters with warm AdamW state, and the board they go to."""

    def __init__(self, root: Path, lr: float) -> None:
        from transformers.utils import logging as hf_logging

        from rollpatch.engines.reference import ReferenceRuntime, make_tiny_model

        hf_logging.disable_progress_bar()
        self.root = root
        self.model = make_tiny_model(root / "model", seed=0, **MODEL_DIMS)
        self.runtime = ReferenceRuntime(self.model, threads=1)  # the reload baselines' runtime
        self.masters = {n: t.to_array().astype(np.float32) for n, t in self.runtime.view.items()}
        self.board_dir = root / "board"
        self.board = f"file://{self.board_dir}"
        self.publisher = Publisher(self.board, RUN, PublisherConfig(keyframe_every=0),
                                   asynchronous=False)
        self.adam = WarmAdamW(self.masters, lr)
        self.digests: dict[int, str] = {}
        self.changed: list[float] = []
        self.view = self.prev_view = cast_view(self.masters, "bf16")
        self._publish()

    def step(self) -> int:
        """One AdamW step of every master, then publish it; returns the version."""
        self.adam.step()
        before = self.prev_view = self.view
        self.view = cast_view(self.masters, "bf16")
        changed = sum(int(np.count_nonzero(before[k].data != t.data)) for k, t in self.view.items())
        self.changed.append(changed / sum(t.n_elements for t in self.view.values()))
        return self._publish()

    def _publish(self) -> int:
        v = self.publisher.publish(self.masters)
        self.digests[v] = self.view.digest()
        target = Board(self.board).manifest(RUN, v).target
        if target != self.digests[v]:
            raise BenchError(f"manifest target of v{v} is not cast_view(masters).digest()")
        return v

    def keyframe_path(self) -> Path:
        m = Board(self.board).manifest(RUN, 0)
        return self.board_dir.joinpath(*m.keyframes[0].ref.key.split("/"))


def _start(world: World, mode: str, poll_s: float = 0.05) -> Any:
    from rollpatch.engines.reference import ReferenceEngine
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    engine = ReferenceEngine.from_dir(world.model, threads=1)
    sc = start_sidecar(world.board, RUN, engine, engine.url,
                       config=SidecarConfig(commit_mode=mode,
                                            follower=FollowerConfig(poll_s=poll_s)))
    want = max(world.digests)
    if not sc.sidecar.follower.wait_for(want, 120):
        raise BenchError(f"{mode} sidecar never reached v{want}: "
                         f"{sc.sidecar.follower.status().last_error}")
    return sc


# -- 1. proxy overhead ---------------------------------------------------------------------------

def bench_proxy(world: World, levels: Sequence[tuple[int, int]], rounds: int
                ) -> list[dict[str, Any]]:
    """Each level: ``rounds`` x (direct, sidecar, sidecar, direct), n / (2 rounds) requests
    each; server CPU is this process's (engine + sidecar) CPU time over each chunk."""
    sc = _start(world, "drain", poll_s=0.5)
    served = sc.sidecar.follower.version
    urls = {"direct": sc.sidecar.engine_url, "sidecar": sc.url}
    texts: dict[str, set[str]] = {}
    out = []
    try:
        for url in urls.values():  # first requests of a process pay one-time costs
            run_load(url, 2, 16, 0)
        for c, n in levels:
            got: dict[str, list[dict[str, Any]]] = {"direct": [], "sidecar": []}
            warmup = min(c, 8)
            for target in ("direct", "sidecar", "sidecar", "direct") * rounds:
                cpu0 = time.process_time()
                r = run_load(urls[target], c, n // (2 * rounds), warmup)
                r["cpu_per_req"] = (time.process_time() - cpu0) / (len(r["lat"]) + warmup)
                got[target].append(r)
                for k, v in r["texts"].items():
                    texts.setdefault(k, set()).update(v)
                if target == "sidecar" and set(r["labels"]) != {f"{served}-{served}"}:
                    raise BenchError(f"sidecar labels {r['labels']} != served v{served}")
            row: dict[str, Any] = {"c": c, "n": n}
            for target, runs in got.items():
                lat = [x for r in runs for x in r["lat"]]
                row[target] = {"p50": _pct(lat, 50), "p99": _pct(lat, 99),
                               "rps": len(lat) / sum(r["wall"] for r in runs),
                               "cpu": statistics.median(r["cpu_per_req"] for r in runs),
                               "errors": [e for r in runs for e in r["errors"]], "lat": lat}
            log(f"c={c}: p50 direct {row['direct']['p50'] * 1e3:.1f} ms, sidecar "
                f"{row['sidecar']['p50'] * 1e3:.1f} ms; req/s {row['direct']['rps']:.1f} vs "
                f"{row['sidecar']['rps']:.1f}; CPU/req {row['direct']['cpu'] * 1e3:.1f} vs "
                f"{row['sidecar']['cpu'] * 1e3:.1f} ms")
            out.append(row)
    finally:
        sc.stop()
    if any(len(v) != 1 for v in texts.values()):
        raise BenchError("the same prompt got different completions at temperature 0")
    return out


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


# -- 2. engine pause per commit -------------------------------------------------------------------

def bench_commits(world: World, mode: str, versions: int) -> dict[str, Any]:
    sc = _start(world, mode)
    records: list[dict[str, Any]] = []
    gate, follower = sc.sidecar.gate, sc.sidecar.follower

    def on_commit(version: int, pause_s: float) -> None:
        st = follower.status()
        records.append({"version": version, "stall_s": pause_s, "swap_s": gate.last_pause_s,
                        "fetch_s": st.last_fetch_s, "stage_s": st.last_stage_s})

    boot_s = gate.pauses[-1] if gate.pauses else None
    follower.on_commit.append(on_commit)
    load = BackgroundLoad(sc.url, BACKGROUND_CONCURRENCY)
    try:
        time.sleep(1.0)  # let the load reach its steady state
        for _ in range(versions):
            v = world.step()
            if not follower.wait_for(v, 120):
                raise BenchError(f"{mode}: v{v} not committed: {follower.status().last_error}")
            if sc.sidecar.engine.digest != world.digests[v]:
                raise BenchError(f"{mode}: engine digest at v{v} is not the publisher's view")
            time.sleep(0.3)  # requests keep flowing between commits
        deadline = time.monotonic() + 30
        while len(records) < versions and time.monotonic() < deadline:
            time.sleep(0.05)  # on_commit runs just after wait_for returns
    finally:
        traffic = load.stop()
        sc.stop()
    check_errors(f"{mode} mode under commits", traffic)
    spans = sum(k for label, k in traffic["labels"].items()
                if label.split("-")[0] != label.split("-")[1])
    if mode == "drain" and spans:
        raise BenchError(f"drain mode: {spans} responses span a commit")
    log(f"{mode}: {len(records)} commits, swap p50 "
        f"{statistics.median(r['swap_s'] for r in records) * 1e3:.1f} ms, {spans} of "
        f"{len(traffic['lat'])} responses span a commit")
    return {"mode": mode, "commits": records, "boot_load_s": boot_s, "requests": len(
        traffic["lat"]), "spanning": spans, "req_p50": _pct(traffic["lat"], 50),
        "errors": traffic["errors"]}


def bench_reload(world: World, repeats: int, cold: bool) -> dict[str, list[float]]:
    """Full reloads vs the last step's patch on the baseline runtime (same model, idle)."""
    from rollpatch.engines.reference import ReferenceEngine, ReferenceRuntime
    from rollpatch.io import load_view
    from rollpatch.patch import decode

    v, board = max(world.digests), Board(world.board)
    blob = board.fetch(board.manifest(RUN, v).patches_from(v - 1)[0].ref)
    engine = ReferenceEngine(world.runtime, serve_http=False)
    prev = world.prev_view
    prev.digest()  # known digests: load_view's lock covers the copy and the re-hash only
    out: dict[str, list[float]] = {"ram": [], "apply": [], "disk": [], "cold": []}
    for i in range(repeats + 1):  # round 0 warms caches and is not kept
        times = {"ram": _timed(lambda: world.runtime.load_view(prev, v - 1))}
        patch = decode(blob, world.runtime.view)
        times["apply"] = _timed(lambda p=patch: engine.apply(p, v))
        if engine.digest != world.digests[v]:
            raise BenchError(f"idle apply of v{v} does not give the publisher's view")
        times["disk"] = _timed(lambda: world.runtime.load_view(load_view(world.keyframe_path()),
                                                                0))
        if world.runtime.digest() != world.digests[0]:
            raise BenchError("reload from the keyframe file is not v0")
        if cold:
            times["cold"] = _timed(lambda: ReferenceRuntime(world.model, threads=1))
        for k, t in times.items():
            if i:
                out[k].append(t)
    return out


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- 3. relay fan-out ----------------------------------------------------------------------------

class CountingStore(Store):
    """A read-only view of a store that counts the bytes and calls it answers."""

    writable = False

    def __init__(self, inner: Store) -> None:
        self.inner, self.uri = inner, inner.uri
        self._lock = threading.Lock()
        self.counts = {"bytes": 0, "object_bytes": 0, "gets": 0, "heads": 0, "lists": 0}

    def _add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v

    def _get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self._add(bytes=len(data), gets=1, object_bytes=len(data) * ("/objects/" in key))
        return data

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        data = self.inner.get_range(key, start, end)
        self._add(bytes=len(data), gets=1, object_bytes=len(data) * ("/objects/" in key))
        return data

    def _head(self, key: str) -> ObjectInfo | None:
        self._add(heads=1)
        return self.inner.head(key)

    def _list(self, prefix: str) -> list[str]:
        self._add(lists=1)
        return self.inner.list(prefix)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        raise NotImplementedError


def _fan_out(world: World, boards: list[Board], counter: CountingStore) -> dict[str, Any]:
    from rollpatch.engines.view_engine import ViewEngine

    last = max(world.digests)
    followers = [Follower(b, RUN, ViewEngine()) for b in boards]
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(len(followers)) as pool:
        for phase, want in (("boot", 0), ("catchup", last)):
            before = dict(counter.counts)
            fetched = sum(f.status().bytes_fetched for f in followers)
            t0 = time.perf_counter()
            got = list(pool.map(lambda f, w=want: f.sync(w), followers))
            wall = time.perf_counter() - t0
            if got != [want] * len(followers):
                raise BenchError(f"followers reached {got}, wanted v{want}")
            for f in followers:
                view: View = f.engine.view  # type: ignore[attr-defined]
                if root_digest({n: t.digest() for n, t in view.items()}) != world.digests[want]:
                    raise BenchError(f"a follower's words at v{want} are not the publisher's")
            out[phase] = {k: counter.counts[k] - before[k] for k in before}
            out[phase]["wall_s"] = wall
            out[phase]["downstream"] = sum(f.status().bytes_fetched for f in followers) - fetched
            plan = followers[0].last_plan
            out[phase]["plan"] = [] if plan is None else [(s.base, s.to) for s in plan.steps]
    return out


def bench_relay(world: World, root: Path) -> dict[str, Any]:
    from rollpatch.relay import RelayConfig, RelayServer

    direct = CountingStore(open_store(world.board))
    plain = _fan_out(world, [Board(direct) for _ in range(FOLLOWERS)], direct)
    upstream = CountingStore(open_store(world.board))
    relay = RelayServer(upstream, RelayConfig(cache_dir=root / "relay-cache"))
    url = relay.start()
    try:
        relayed = _fan_out(world, [Board(open_store(url)) for _ in range(FOLLOWERS)], upstream)
        metric = relay.relay.metrics.total("rollpatch_relay_upstream_bytes_total")
    finally:
        relay.stop()
    if metric != upstream.counts["bytes"]:
        raise BenchError(f"relay metric says {metric} upstream bytes, the store saw "
                         f"{upstream.counts['bytes']}")
    log(f"relay: upstream {direct.counts['bytes']:,} B direct vs {upstream.counts['bytes']:,} B "
        "through the relay")
    return {"direct": plain, "relay": relayed, "relay_metric_bytes": metric}


# -- report --------------------------------------------------------------------------------------

def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.2f} s"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _row(part: str, case: str, metric: str, mine: str, base: str, added: str, ratio: float,
         vs: str) -> list[str]:
    return [part, case, metric, mine, base, added, f"{ratio:.2f}" if not math.isnan(ratio) else "-", vs]


def proxy_rows(proxy: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in proxy:
        s, d, case = r["sidecar"], r["direct"], f"c={r['c']}, {r['n']} req"
        for q in ("p50", "p99"):
            rows.append(_row("proxy", case, f"{q} latency", _ms(s[q]), _ms(d[q]),
                             f"{(s[q] - d[q]) * 1e3:+.1f} ms", s[q] / d[q], "direct"))
        rows.append(_row("proxy", case, "throughput", f"{s['rps']:.1f}/s", f"{d['rps']:.1f}/s",
                         f"{s['rps'] - d['rps']:+.1f}/s", s["rps"] / d["rps"], "direct"))
        rows.append(_row("proxy", case, "server CPU/req", _ms(s["cpu"]), _ms(d["cpu"]),
                         f"{(s['cpu'] - d['cpu']) * 1e3:+.1f} ms", s["cpu"] / d["cpu"],
                         "direct"))
    return rows


def commit_rows(modes: list[dict[str, Any]], reload: dict[str, list[float]]
                ) -> list[list[str]]:
    med = statistics.median
    ram, disk, cold = med(reload["ram"]), med(reload["disk"]), med(reload["cold"])
    idle = med(reload["apply"])
    rows = [_row("commit", "idle, no server", "swap p50", _ms(idle), _ms(ram),
                 f"{(idle - ram) * 1e3:+.1f} ms", idle / ram, "reload, view in RAM")]
    for m in modes:
        swap = [r["swap_s"] for r in m["commits"]]
        stall = [r["stall_s"] for r in m["commits"]]
        staging = [r["fetch_s"] + r["stage_s"] for r in m["commits"]]
        case = f"{m['mode']}, {len(swap)} commits"
        rows += [
            _row("commit", case, "swap p50", _ms(med(swap)), _ms(ram),
                 f"{(med(swap) - ram) * 1e3:+.1f} ms", med(swap) / ram, "reload, view in RAM"),
            _row("commit", case, "swap p50", _ms(med(swap)), _ms(disk),
                 f"{(med(swap) - disk) * 1e3:+.1f} ms", med(swap) / disk, "reload from disk"),
            _row("commit", case, "swap p50", _ms(med(swap)), _ms(cold), "-", med(swap) / cold,
                 "cold engine load"),
            _row("commit", case, "swap max", _ms(max(swap)), _ms(max(reload["ram"])), "-",
                 max(swap) / max(reload["ram"]), "reload in RAM, max"),
            _row("commit", case, "stall p50", _ms(med(stall)), "-", "-", float("nan"),
                 "drain wait + swap" if m["mode"] == "drain" else "= swap + resume"),
            _row("commit", case, "staging p50", _ms(med(staging)), "-", "-", float("nan"),
                 "fetch+decode, serving"),
        ]
    return rows


def relay_rows(relay: dict[str, Any], last: int) -> list[list[str]]:
    rows = []
    for phase, case in (("boot", f"{FOLLOWERS} boot to v0"),
                        ("catchup", f"{FOLLOWERS} v0 -> v{last}")):
        r, d = relay["relay"][phase], relay["direct"][phase]
        rows += [
            _row("relay", case, "upstream bytes", _mb(r["bytes"]), _mb(d["bytes"]), "-",
                 r["bytes"] / d["bytes"], "no relay"),
            _row("relay", case, "upstream GETs", str(r["gets"]), str(d["gets"]), "-",
                 r["gets"] / d["gets"], "no relay"),
        ]
    return rows


def _failures(ctx: dict[str, Any]) -> str:
    parts = [f"{t} c={r['c']}: {len(r[t]['errors'])}" for r in ctx["proxy"]
             for t in ("sidecar", "direct")]
    parts += [f"{m['mode']} mode: {len(m['errors'])}" for m in ctx["commits"]]
    return ", ".join(parts)


def render(ctx: dict[str, Any]) -> str:
    headers = ["part", "case", "metric", "rollpatch", "baseline", "added", "ratio", "baseline is"]
    rows = (proxy_rows(ctx["proxy"]) + commit_rows(ctx["commits"], ctx["reload"])
            + relay_rows(ctx["relay"], ctx["last_version"]))
    right = [False, False, False, True, True, True, True, False]
    a, c0 = ctx["args"], ctx["relay"]["direct"]["catchup"]
    patch_kb = statistics.median(ctx["patch_bytes"]) / 1e3
    foot = [
        "",
        (f"machine: {machine_line(ctx['machine'])}; load avg {ctx['load'][0]:.1f} at start, "
         f"{ctx['load'][1]:.1f} at end (shared: compare rows of this run only); "
         f"{ctx['wall_s'] / 60:.1f} min wall"),
        (f"model: make_tiny_model hidden 256, 4 layers, vocab 2048 ({ctx['params'] / 1e6:.1f}M "
         f"params, {_mb(ctx['view_bytes'])} bf16 view); reference engine threads=1, server and "
         "sidecar in one process, load generator in another"),
        (f"versions: AdamW lr {a['lr']:g}, {100 * statistics.median(ctx['changed']):.2f}% of "
         f"bf16 values change per step (median); step patch {patch_kb:.0f} kB (median) vs "
         f"{_mb(ctx['keyframe_bytes'])} keyframe"),
        "rollpatch  through rollpatch (sidecar / patch commit / relay); baseline: without it",
        "added      rollpatch - baseline; ratio = rollpatch / baseline (< 1: rollpatch smaller)",
        (f"proxy      {MAX_TOKENS}-token completions, temperature 0, c concurrent requests "
         "(closed loop); baseline = the same engine's own URL; chunks in the order "
         f"{'(direct, sidecar, sidecar, direct) x ' + str(ctx['rounds'])};"),
        ("           latency = client-side wall per request (pooled); throughput = requests / "
         "wall; server CPU/req = CPU time of the engine+sidecar process per request"),
        ("           (median over chunks; immune to other jobs' load, unlike the wall-clock "
         "rows)"),
        ("commit     swap = CommitGate pause per commit (weight write, digest re-hash; pause "
         "mode adds the wait for the forward in flight);"),
        (f"           under {BACKGROUND_CONCURRENCY} concurrent requests; stall = the "
         "follower's pause_s (drain: admission closed, includes waiting for in-flight "
         "requests)"),
        ("           reload, view in RAM = ReferenceRuntime.load_view of the full view (copy + "
         "re-hash under the lock); reload from disk ="),
        ("           read + parse the keyframe .safetensors (page cache warm) + load_view; cold "
         "= ReferenceRuntime(model_dir); baselines on a separate"),
        ("           runtime, idle, after each mode; idle swap = ReferenceEngine.apply of the "
         "last step's patch on that runtime, alternated with the"),
        (f"           RAM reload; medians of {len(ctx['reload']['ram'])} "
         f"({len(ctx['reload']['cold'])} cold)"),
        "           staging = fetch + decode before the commit, while the engine keeps serving",
        (f"relay      {FOLLOWERS} Followers on ViewEngines sync at once; upstream = bytes/GETs "
         "the file:// board answered (objects, manifests, LATEST);"),
        (f"           each follower downloads {_mb(c0['downstream'] / FOLLOWERS)} for the "
         f"catch-up (plan {ctx['relay_plan']}), the same with or without the relay"),
        (f"verified:  {ctx['n_checked']} engine/follower digests equal cast_view(masters) "
         f"computed here; identical text per prompt on both proxy paths; {ctx['spanning']} of "
         f"{ctx['bg_requests']} pause-mode responses span a commit (drain: 0)"),
        (f"failed:    requests that got no 200 (excluded above; listed in --json): "
         f"{_failures(ctx)}"),
    ]
    return table(headers, rows, right) + "\n" + "\n".join(foot)


# -- main ----------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--load-worker"]:
        return load_worker_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and versions")
    ap.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate")
    ap.add_argument("--versions", type=int, default=None,
                    help="versions published per commit mode (default 12, quick 4)")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    versions = args.versions or (4 if args.quick else 12)
    levels = [(1, 40), (16, 96), (64, 128)] if args.quick else [(1, 200), (16, 640), (64, 640)]
    mach = machine()
    load0 = mach["loadavg_1m"] or 0.0
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rp-bench-sidecar-") as tmp:
        root = Path(tmp)
        log("building the model and publishing v0")
        world = World(root, args.lr)
        log("1/3 proxy overhead")
        proxy = bench_proxy(world, levels, 1 if args.quick else 2)
        log("2/3 commits vs reloads")
        commits: list[dict[str, Any]] = []
        reload: dict[str, list[float]] = {}
        reps = 4 if args.quick else 8
        for i, mode in enumerate(("drain", "pause")):
            commits.append(bench_commits(world, mode, versions))
            more = bench_reload(world, reps, cold=i == 0)
            for k, v in more.items():
                reload.setdefault(k, []).extend(v)
        log("3/3 relay fan-out")
        relay = bench_relay(world, root)
        board = Board(world.board)
        last = max(world.digests)
        ctx = {
            "args": vars(args), "machine": mach, "rounds": 1 if args.quick else 2, "proxy": proxy, "commits": commits,
            "reload": reload, "relay": relay, "last_version": last,
            "changed": world.changed, "params": sum(t.n_elements for t in world.view.values()),
            "view_bytes": world.view.nbytes,
            "keyframe_bytes": board.manifest(RUN, 0).keyframes[0].ref.size,
            "patch_bytes": [board.manifest(RUN, v).patches_from(v - 1)[0].ref.size
                            for v in range(1, last + 1)],
            "relay_plan": " ".join(f"{b}->{t}" for b, t in
                                   relay["direct"]["catchup"]["plan"]),
            "n_checked": 2 * versions + 4 * FOLLOWERS + 2 * (reps + 1),
            "spanning": commits[1]["spanning"], "bg_requests": commits[1]["requests"],
        }
    ctx["wall_s"] = time.perf_counter() - t_start
    ctx["load"] = (load0, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
    print(render(ctx))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ctx, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
