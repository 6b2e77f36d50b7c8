"""The timed paths of bench/vllm.py against one vLLM server: staged commits, catch-ups,
the inline commit and vLLM's own reload_weights (the module docstring of bench/vllm.py says
what each measures)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from _util import log
from _vllm_reference import CATCHUP_REPS, catchup_starts, follower, sync_to
from _vllm_server import BenchError, Server, greedy
from _vllm_world import World

PROMPT = "What is 12 + 7? The answer is"


# -- the paths -----------------------------------------------------------------------------------


def record_staging(
    engine: Any, sizes: list[int], phases: list[dict[str, float]], mems: list[dict[str, float]]
) -> None:
    """Remember each staged update's size, phases and memory by phase (the bench wraps the
    instance's method)."""
    inner = engine.stage_encoded

    def stage_encoded(steps: Any, version: int) -> Any:
        staged = inner(steps, version)
        sizes.append(staged.nbytes)
        phases.append(dict(staged.payload.get("stage_phases") or {}))
        mems.append(dict(staged.payload.get("stage_memory") or {}))
        return staged

    engine.stage_encoded = stage_encoded


def phase_staged(
    world: World,
    engine: Any,
    server: Server,
    prompt_ids: list[int],
    sizes: list[int],
    phases: list[dict[str, float]],
    mems: list[dict[str, float]],
    pid: int,
) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    f, out, served = follower(world, engine), [], {}
    for v in range(1, len(world.digests)):
        rec = sync_to(f, world, v, [pid])
        rec["worker_commit_s"] = engine.last_timings["worker_ms"] / 1e3
        rec["staged_bytes"] = sizes[-1]
        rec["stage_phases_ms"] = phases[-1]
        rec["stage_memory_mib"] = mems[-1]
        settled = settle(engine)  # the words written after the pause
        rec["phases_ms"]["after_pause_ms"] = float(settled.get("ms", 0.0))
        out.append(rec)
        served[v] = greedy(engine.http, server.model, prompt_ids)
        log(
            f"  staged v{v}: stage {rec['stage_s'] * 1e3:.0f} ms, pause "
            f"{rec['pause_s'] * 1e3:.1f} ms ({_parts(phases[-1])})"
        )
    return out, served


def _parts(ms: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in ms.items())


def phase_inline(world: World, engine: Any) -> list[dict[str, float]]:
    out = []
    for v in range(1, len(world.digests)):
        blob = world.patch_blob(v)
        t0 = time.perf_counter()
        engine.apply_encoded(blob, v)
        pause = time.perf_counter() - t0
        if (engine.version, engine.digest) != (v, world.digests[v]):
            raise BenchError(f"v{v}: the engine does not hold the published digest")
        out.append(
            {
                "pause_s": pause,
                "worker_s": engine.last_timings["worker_ms"] / 1e3,
                "phases_ms": dict(engine.last_timings),
            }
        )
        log(f"  inline v{v}: pause {pause * 1e3:.0f} ms")
    return out


def reload(http: Any, path: Path) -> None:
    http.post(
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(path)}, "timeout": 600},
    )


def reload_paused(http: Any, path: Path, v: int) -> dict[str, float]:
    """vLLM's own full update of version ``v``: ``/pause?mode=keep``, ``reload_weights`` of
    its checkpoint directory, the version tag, the prefix-cache reset, ``/resume``; returns
    each call's ms under the pause breakdown's names (``rpc_ms``: ``reload_weights`` alone,
    beside the four control round trips a staged commit with the engine-core hook skips)."""
    ms: dict[str, float] = {}

    def timed(name: str, call: Any) -> None:
        t0 = time.perf_counter()
        call()
        ms[name] = (time.perf_counter() - t0) * 1e3

    timed("pause_call_ms", lambda: http.post("/pause?mode=keep"))
    timed("rpc_ms", lambda: reload(http, path))
    timed("tag_ms", lambda: http.post("/update_weight_version", {"new_version": str(v)}))
    timed("reset_ms", lambda: http.post("/reset_prefix_cache"))
    timed("resume_call_ms", lambda: http.post("/resume"))
    return ms


def settle(engine: Any) -> dict[str, Any]:
    """Wait for the words a staged commit writes after its pause (kernel-only parameters,
    :class:`Settler`): vLLM's own ``reload_weights`` must not run under them (the settler
    would write the committed version's words over the reloaded ones)."""
    return dict(engine._call("settled")["settle"])


def back_to(world: World, engine: Any, v: int = 0) -> None:
    """Untimed: the engine on version ``v`` again (reload of its checkpoint), once the words
    the last commit writes after its pause are written (else they land on the reloaded
    weights: seen under load, as a root that is neither version)."""
    settle(engine)
    reload(engine.http, world.checkpoint(v))
    engine.adopt(v, world.digests[v])


def phase_reloads(
    world: World, engine: Any, server: Server, prompt_ids: list[int], served: dict[int, Any]
) -> list[dict[str, float]]:
    http, out = engine.http, []
    for v in range(1, len(world.digests)):
        settle(engine)  # untimed: nothing of the previous commit is still being written
        ckpt = world.warm(v)  # page cache warm before the clock starts
        t0 = time.perf_counter()
        parts = reload_paused(http, ckpt, v)
        pause = time.perf_counter() - t0
        if engine.held(fresh=True)[1] != world.digests[v]:  # untimed: re-hash in the workers
            raise BenchError(f"v{v}: after reload_weights the engine holds other bits")
        if greedy(http, server.model, prompt_ids) != served[v]:
            raise BenchError(f"v{v}: the reloaded engine answers differently from the patched")
        out.append({"pause_s": pause, "phases_ms": parts})
        log(f"  reload v{v}: pause {pause * 1e3:.0f} ms")
    return out


def phase_catchups(
    world: World,
    engine: Any,
    lag: int,
    sizes: list[int],
    phases: list[dict[str, float]],
    mems: list[dict[str, float]],
    pid: int,
) -> dict[str, list[dict[str, Any]]]:
    """Each catch-up row (from the anchor, off it, 1 behind) as one sync, the rows in turn,
    :data:`CATCHUP_REPS` times: {row: its samples}."""
    ends = catchup_starts(world, lag)
    log(f"catch-up: {ends} (start, target) in one sync each, {CATCHUP_REPS} times")
    catchups: dict[str, list[dict[str, Any]]] = {k: [] for k in ends}
    for _ in range(CATCHUP_REPS):  # the rows in turn
        for k, (start, end) in ends.items():
            back_to(world, engine, start)
            rec = sync_to(follower(world, engine), world, end, [pid])
            rec["stage_phases_ms"] = phases[-1]
            rec["stage_memory_mib"] = mems[-1]
            rec["staged_bytes"] = sizes[-1]
            catchups[k].append(rec)
            log(
                f"  catch-up from v{start} ({len(rec['hops'])} hops): stage "
                f"{rec['stage_s'] * 1e3:.0f} ms ({_parts(phases[-1])})"
            )
    return catchups
