"""bench/vllm.py's follower glue and the built-in engine's paths: staged commits in place and
double-buffered, catch-ups (from an anchor: the folded patch; off the anchors: the chain, or
after following from the anchor, the rewind + the folded patch),
keyframe loads and the in-place floor (see that module)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from _util import cpu_of
from _vllm_floor import inplace_floor
from _vllm_server import BenchError
from _vllm_world import RUN, World

#: Versions behind for the catch-up rows (``min`` with the versions published).
CATCHUP = 5
#: Catch-ups timed per engine and row (one sample swung 1.7-2.9x between runs on the shared
#: machine; medians of three still did: the chain's ratio was 1.66x and 2.66x in two runs of
#: the same code at load 5-6).
CATCHUP_REPS = 5
#: The catch-up rows, timed in turn (so the ratios compare syncs at the same load): 1 behind
#: (v(k-1) -> vk, the denominator), k behind from an anchor (v0 -> vk: the folded patch, one
#: hop), k behind off the anchors booted at v1 (v1 -> v(k+1): no records, the chain of step
#: patches) and k behind from v1 after following from v0 (the engine's records of v0 -> v1
#: rebuild v0's words: the folded patch v0 -> v(k+1), one hop; built-in engine only).
ONE, ANCHOR, OFF_ANCHOR, FOLLOWED = "one", "anchor", "chain", "followed"


def cpu_s(pids: Sequence[int] = ()) -> float:
    """CPU seconds (user + system, all threads) of this process and of ``pids`` so far."""
    return cpu_of(pids)


def catchup_starts(world: World, lag: int) -> dict[str, tuple[int, int]]:
    """The catch-up rows' (start, target) versions: 1 behind and from v0 always, off the
    anchors when a fold is published and the run is long enough for a lag from v1."""
    out = {ONE: (lag - 1, lag), ANCHOR: (0, lag)}
    if world.fold_every and len(world.digests) > lag + 1:
        out[OFF_ANCHOR] = (1, lag + 1)
    return out


def reference_starts(world: World, lag: int) -> dict[str, tuple[int, int]]:
    """:func:`catchup_starts` plus, off the anchors, the replica that followed from v0."""
    out = catchup_starts(world, lag)
    if OFF_ANCHOR in out:
        out[FOLLOWED] = out[OFF_ANCHOR]
    return out


def follower(world: World, engine: Any) -> Any:
    from rollpatch.follower import Follower, FollowerConfig
    from rollpatch.follower.commit import CommitGate

    cfg = FollowerConfig(audit_bytes_per_s=None)  # the audit is measured by itself, not here
    return Follower(world.board, RUN, engine, cfg, gate=CommitGate(engine, "pause"))


def sync_to(f: Any, world: World, v: int, pids: Sequence[int] = ()) -> dict[str, Any]:
    """One ``Follower.sync(v)``, timed: wall, CPU (this process and ``pids``), the plan."""
    c0 = cpu_s(pids)
    t0 = time.perf_counter()
    if f.sync(v) != v or f.engine.digest != world.digests[v]:
        raise BenchError(f"v{v}: the engine does not hold the published digest")
    total = time.perf_counter() - t0
    cpu = cpu_s(pids) - c0
    st, last = f.status(), f.gate.last
    return {
        "pause_s": last.pause_s,
        "stage_s": st.last_stage_s,
        "fetch_s": st.last_fetch_s,
        "visible_to_serving_s": total,
        "cpu_s": cpu,
        "hops": [[s.base, s.to] for s in f.last_plan.steps] if f.last_plan else [],
        "load": os.getloadavg()[0],
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
        ends = reference_starts(world, catchup)
        catch: dict[str, list[dict[str, Any]]] = {k: [] for k in ends}
        for _ in range(CATCHUP_REPS):  # the rows in turn
            for k, (start, end) in ends.items():
                boot = 0 if k == FOLLOWED else start  # followed: booted at v0, synced to v1
                eng.load(load_view(world.checkpoint(boot) / "model.safetensors"), boot)
                f = follower(world, eng)
                if boot != start:
                    sync_to(f, world, start)  # untimed: the commit v0 -> v1 leaves its record
                catch[k].append(sync_to(f, world, end))
                if k == FOLLOWED and catch[k][-1]["hops"][0][0] != 0:
                    raise BenchError(f"followed catch-up did not rewind: {catch[k][-1]['hops']}")
        loads = []
        for v in range(1, len(world.digests)):
            view = load_view(world.checkpoint(v) / "model.safetensors")
            # the keyframe's own digest is known before a reload (its manifest names it, and
            # a follower proves it while fetching): hash it here, untimed, as the staged
            # paths prove their targets before the pause; what the gate times is then the
            # copy and the re-hash of the live words, as in bench/sidecar.py's RAM reload
            view.digest()
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
        "reference_catchup": catch[ANCHOR],
        "reference_catchup_one": catch[ONE],
        "reference_catchup_chain": catch.get(OFF_ANCHOR, []),
        "reference_catchup_followed": catch.get(FOLLOWED, []),
        "reference_loads": loads,
        "reference_floor": floor,
    }
