"""bench/sidecar.py's world (a model, masters under AdamW, a board) and its commit parts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _sidecar_load import BackgroundLoad, BenchError, check_errors
from _util import WarmAdamW, log

from rollpatch.board import Board
from rollpatch.follower import FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig

RUN = "bench"
MODEL_DIMS = {"hidden_size": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 688}
BACKGROUND_CONCURRENCY = 4


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
        self.publisher = Publisher(
            self.board, RUN, PublisherConfig(keyframe_every=0), asynchronous=False
        )
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
    sc = start_sidecar(
        world.board,
        RUN,
        engine,
        engine.url,
        config=SidecarConfig(commit_mode=mode, follower=FollowerConfig(poll_s=poll_s)),
    )
    want = max(world.digests)
    if not sc.sidecar.follower.wait_for(want, 120):
        raise BenchError(
            f"{mode} sidecar never reached v{want}: {sc.sidecar.follower.status().last_error}"
        )
    return sc


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def bench_commits(world: World, mode: str, versions: int) -> dict[str, Any]:
    sc = _start(world, mode)
    records: list[dict[str, Any]] = []
    gate, follower = sc.sidecar.gate, sc.sidecar.follower

    def on_commit(version: int, pause_s: float) -> None:
        st = follower.status()
        last = gate.last
        assert last is not None
        records.append(
            {
                "version": version,
                "swap_s": pause_s,
                "stall_s": last.drain_s + last.pause_s,
                "fetch_s": st.last_fetch_s,
                "stage_s": st.last_stage_s,
            }
        )

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
    spans = sum(
        k for label, k in traffic["labels"].items() if label.split("-")[0] != label.split("-")[1]
    )
    if mode == "drain" and spans:
        raise BenchError(f"drain mode: {spans} responses span a commit")
    log(
        f"{mode}: {len(records)} commits, swap p50 "
        f"{statistics.median(r['swap_s'] for r in records) * 1e3:.1f} ms, {spans} of "
        f"{len(traffic['lat'])} responses span a commit"
    )
    return {
        "mode": mode,
        "commits": records,
        "boot_load_s": boot_s,
        "requests": len(traffic["lat"]),
        "spanning": spans,
        "req_p50": _pct(traffic["lat"], 50),
        "errors": traffic["errors"],
    }


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
    out: dict[str, list[float]] = {"ram": [], "stage": [], "apply": [], "disk": [], "cold": []}
    for i in range(repeats + 1):  # round 0 warms caches and is not kept
        times = {"ram": _timed(lambda: world.runtime.load_view(prev, v - 1))}
        patch = decode(blob, world.runtime.view)
        t0 = time.perf_counter()
        staged = engine.stage(patch, v)  # proven while it could serve: not a pause
        times["stage"] = time.perf_counter() - t0
        times["apply"] = _timed(lambda st=staged: engine.commit_staged(st, v))
        if engine.digest != world.digests[v]:
            raise BenchError(f"idle apply of v{v} does not give the publisher's view")
        times["disk"] = _timed(lambda: world.runtime.load_view(load_view(world.keyframe_path()), 0))
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
