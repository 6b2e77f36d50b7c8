"""bench/vllm.py's follower glue and the built-in engine's paths: staged commits in place and
double-buffered, catch-ups, keyframe loads and the in-place floor (see that module)."""

from __future__ import annotations

import time
from typing import Any

from _vllm_floor import inplace_floor
from _vllm_server import BenchError
from _vllm_world import RUN, World

#: Versions behind for the catch-up rows (``min`` with the versions published).
CATCHUP = 5
#: Catch-ups timed per engine (one sample swung 1.7-2.9x between runs on the shared machine).
CATCHUP_REPS = 3


def follower(world: World, engine: Any) -> Any:
    from rollpatch.follower import Follower, FollowerConfig
    from rollpatch.follower.commit import CommitGate

    cfg = FollowerConfig(audit_bytes_per_s=None)  # the audit is measured by itself, not here
    return Follower(world.board, RUN, engine, cfg, gate=CommitGate(engine, "pause"))


def sync_to(f: Any, world: World, v: int) -> dict[str, float]:
    t0 = time.perf_counter()
    if f.sync(v) != v or f.engine.digest != world.digests[v]:
        raise BenchError(f"v{v}: the engine does not hold the published digest")
    total = time.perf_counter() - t0
    st, last = f.status(), f.gate.last
    return {
        "pause_s": last.pause_s,
        "stage_s": st.last_stage_s,
        "fetch_s": st.last_fetch_s,
        "visible_to_serving_s": total,
        "phases_ms": dict(getattr(f.engine, "last_timings", {})),
    }


def phase_reference(world: World, catchup: int) -> dict[str, Any]:
    """The built-in engine: staged follower commits, a catch-up, and full keyframe loads."""
    from rollpatch.engines.reference import ReferenceEngine
    from rollpatch.io.safetensors import load_view

    eng = ReferenceEngine.from_dir(world.checkpoint(0), threads=1, serve_http=False)
    try:
        eng.load(load_view(world.checkpoint(0) / "model.safetensors"), 0)
        f = follower(world, eng)
        kept: list[Any] = []
        commit_staged = eng.commit_staged

        def keep(update: Any, version: int) -> None:
            commit_staged(update, version)
            kept[:] = [update]  # the last one, for the in-place floor

        eng.commit_staged = keep
        staged = [sync_to(f, world, v) for v in range(1, len(world.digests))]
        del eng.commit_staged
        floor = inplace_floor(eng, kept.pop())
        eng.load(load_view(world.checkpoint(0) / "model.safetensors"), 0)
        eng.writes = "double_buffer"
        f = follower(world, eng)
        double = [sync_to(f, world, v) for v in range(1, len(world.digests))]
        eng.writes = "in_place"
        catch = []
        for _ in range(CATCHUP_REPS):
            eng.load(load_view(world.checkpoint(0) / "model.safetensors"), 0)
            f = follower(world, eng)
            catch.append(sync_to(f, world, catchup))
        loads = []
        for v in range(1, len(world.digests)):
            view = load_view(world.checkpoint(v) / "model.safetensors")
            t0 = time.perf_counter()
            f.gate.run(lambda view=view, v=v: eng.load(view, v))
            loads.append({"pause_s": f.gate.last.pause_s, "call_s": time.perf_counter() - t0})
            if eng.digest != world.digests[v]:
                raise BenchError(f"v{v}: the built-in engine's keyframe load missed")
    finally:
        eng.close()
    return {
        "reference": staged,
        "reference_double": double,
        "reference_catchup": catch,
        "reference_loads": loads,
        "reference_floor": floor,
    }
