"""bench/sidecar.py's proxy part: the engine and the sidecar each in its own process, the
direct and the sidecar path measured in alternated time-based chunks.

Why time-based chunks: issue 10 wants the sidecar path within 5% of the direct path's
throughput. A chunk of a fixed request count lasted under a second in front of vLLM at c >= 16,
so one engine-side hiccup (all requests in flight delayed together) decided a row. Each chunk
now lasts ``chunk_s`` seconds (no request starts after that; those in flight finish), and the
paths alternate in pairs ``(direct, sidecar), (sidecar, direct), ...``: each pair gives one
sidecar/direct throughput ratio and one p50 difference, so a row reports their spread beside
the pooled figures, and whether every pair met the targets.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from _sidecar_engine import cpu_s, engine_process
from _sidecar_load import BenchError, bodies, run_load
from _sidecar_proc import SidecarProcess
from _sidecar_world import RUN, World, _pct
from _util import log

#: Issue 10's targets for the sidecar in front of an engine in its own process.
TARGET_RATIO, TARGET_P50_ADDED_S = 0.95, 1e-3


def meets(ratio: float, p50_added_s: float) -> bool:
    """Whether a throughput ratio (sidecar / direct) and a p50 added meet both targets."""
    return ratio >= TARGET_RATIO and p50_added_s <= TARGET_P50_ADDED_S


def chunk_order(pairs: int) -> list[str]:
    """``pairs`` alternations, each pair's first path the other pair's last: D S S D D S ..."""
    order: list[str] = []
    for i in range(pairs):
        order += ["direct", "sidecar"] if i % 2 == 0 else ["sidecar", "direct"]
    return order


def pair_stats(chunks: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per consecutive (direct, sidecar) pair of chunks: throughput ratio and p50 added."""
    out = []
    for a, b in zip(chunks[0::2], chunks[1::2], strict=False):
        d, s = (a, b) if a["target"] == "direct" else (b, a)
        if d["target"] != "direct" or s["target"] != "sidecar":
            raise ValueError("chunks must come in (direct, sidecar) pairs")
        ratio, added = s["rps"] / d["rps"], s["p50"] - d["p50"]
        out.append(
            {
                "ratio": ratio,
                "p50_added": added,
                "met": float(meets(ratio, added)),
            }
        )
    return out


def bench_proxy(
    world: World,
    kind: str,
    levels: Sequence[int],
    pairs: int,
    chunk_s: float,
    shapes: Sequence[str] = ("stream",),
    loop: str = "fast",
    http: str = "fast",
    relay: str = "tap",
) -> list[dict[str, Any]]:
    """For each shape (``stream``: SSE, ``once``: one JSON answer) and level: ``pairs`` pairs
    of ``chunk_s``-second chunks (:func:`chunk_order`). CPU per request: the sidecar's and the
    engine's (their processes, from /proc), each over the chunk."""
    _, model, url, pid, stop = engine_process(world, kind)
    try:
        sc = SidecarProcess(
            {
                "board": world.board,
                "run": RUN,
                "kind": kind,
                "url": url,
                "digest": world.digests[0],
                "loop": loop,
                "http": http,
                "tap": relay == "tap",
            }
        )
    except BaseException:
        stop()
        raise
    urls = {"direct": url, "sidecar": sc.url}
    texts: dict[str, dict[str, set[str]]] = {}  # prompt -> text -> where it came (path, c)
    out = []
    try:
        for shape, c in ((s, c) for s in shapes for c in levels):
            body = bodies(model, stream=shape == "stream")
            if c == levels[0]:  # first requests of a process (and shape) pay one-time costs
                for u in urls.values():
                    run_load(u, 2, 16, 0, body)
            chunks: list[dict[str, Any]] = []
            for target in chunk_order(pairs):
                cpu0, eng0 = cpu_s(sc.pid), cpu_s(pid)
                r = run_load(urls[target], c, None, min(c, 8), body, duration_s=chunk_s)
                done = len(r["lat"]) + min(c, 8)
                r["cpu_per_req"] = (cpu_s(sc.pid) - cpu0) / done
                r["engine_cpu_per_req"] = (cpu_s(pid) - eng0) / done
                for k, v in r["texts"].items():
                    for t in v:
                        texts.setdefault(k, {}).setdefault(t, set()).add(f"{target} {shape} c={c}")
                if target == "sidecar" and set(r["labels"]) != {"0-0"}:
                    raise BenchError(f"sidecar labels {r['labels']} != served v0")
                chunks.append(
                    {
                        "target": target,
                        "rps": len(r["lat"]) / r["wall"],
                        "p50": _pct(r["lat"], 50),
                        "max": max(r["lat"]),
                        "wall": r["wall"],
                        "cpu": r["cpu_per_req"],
                        "engine_cpu": r["engine_cpu_per_req"],
                        "client_cpu": r["client_cpu_per_req"],
                        "errors": r["errors"],
                        "lat": r["lat"],
                        "start": r["start"],
                    }
                )
            row = _row(kind, shape, c, chunks)
            log(
                f"{kind} {shape} c={c}: p50 direct {row['direct']['p50'] * 1e3:.1f} ms, sidecar "
                f"{row['sidecar']['p50'] * 1e3:.1f} ms; req/s {row['direct']['rps']:.1f} vs "
                f"{row['sidecar']['rps']:.1f}; pair ratios "
                + ", ".join(f"{p['ratio']:.2f}" for p in row["pairs"])
                + f"; sidecar CPU/req {row['sidecar']['cpu'] * 1e3:.2f} ms, load generator "
                f"CPU/req {row['sidecar']['client_cpu'] * 1e3:.2f} ms"
            )
            out.append(row)
    finally:
        sc.stop()
        stop()
    _check_texts(kind, texts)
    return out


def _check_texts(kind: str, texts: dict[str, dict[str, set[str]]]) -> None:
    """At temperature 0 the sidecar must return the engine's completion. Where the engine
    alone gave one completion for a prompt, any other from the sidecar aborts the run. An
    engine that is not batch invariant (vLLM's CPU kernels: a prompt's logits depend on the
    batch it ran in) gives several on the direct path too; then a completion only the
    sidecar returned cannot be told from the engine's variance, and the run says so."""
    for k, got in sorted(texts.items()):
        if len(got) == 1:
            continue
        where = "; ".join(f"{t!r} from {', '.join(sorted(w))}" for t, w in got.items())
        direct = {t for t, w in got.items() if any(x.startswith("direct ") for x in w)}
        if len(direct) <= 1:
            raise BenchError(f"prompt {k}: the sidecar changed a completion ({kind}): {where}")
        log(
            f"{kind}: prompt {k} got {len(got)} completions at temperature 0, {len(direct)} "
            f"on the direct path (the engine is not batch invariant): {where}"
        )


def _row(kind: str, shape: str, c: int, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row: each path's chunks pooled (latency percentiles over all its requests,
    throughput = requests / summed wall, CPU medians over chunks), plus the pairs."""
    row: dict[str, Any] = {"engine": kind, "shape": shape, "c": c, "chunks": chunks}
    row["pairs"] = pair_stats(chunks)
    n = 0
    for target in ("direct", "sidecar"):
        runs = [ch for ch in chunks if ch["target"] == target]
        lat = [x for ch in runs for x in ch["lat"]]
        n += len(lat)
        row[target] = {
            "p50": _pct(lat, 50),
            "p99": _pct(lat, 99),
            "rps": len(lat) / sum(ch["wall"] for ch in runs),
            "cpu": statistics.median(ch["cpu"] for ch in runs),
            "engine_cpu": statistics.median(ch["engine_cpu"] for ch in runs),
            "client_cpu": statistics.median(ch["client_cpu"] for ch in runs),
            "errors": [e for ch in runs for e in ch["errors"]],
        }
    row["n"] = n
    return row
