"""Subprocess entry point of ``bench/board.py``: one replica catching up, in its own process.

Reads one JSON job on stdin, writes one JSON result on stdout (progress goes to stderr), so
the follower's peak RSS (VmHWM) is its own and not the publisher's or the simulator's.

Job fields: ``run``, ``want``, ``have`` (None: an empty engine boots from a keyframe),
``path``, ``board`` / ``board_options`` (the store measured), ``base_view`` (safetensors of
version ``have`` written by the publishing process: the replica's starting words, loaded
untimed), ``expected`` (version → root digest of ``cast_view`` computed by the publishing
process). Paths:

- ``chain``: the step patches one by one, one ``sync`` and one commit per version;
- ``composed``: the step patches only, in one ``sync`` (the follower composes them into one
  commit, as it does on a board without skip patches);
- ``folded``: one ``sync`` with the board's fewest-bytes plan (skip patches), one commit;
- ``keyframe``: an empty engine's ``sync`` (keyframe, then the fewest-bytes patches).

The replica's root digest is recomputed from its words at the end and compared with
``expected``; any mismatch exits non-zero.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from _util import current_rss, peak_rss, reset_peak_rss

from rollpatch.board import Board, Plan, PlanStep
from rollpatch.engines.view_engine import ViewEngine
from rollpatch.errors import NoPathError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.io.safetensors import load_view
from rollpatch.store import open_store
from rollpatch.view import View, root_digest


class ChainBoard(Board):
    """Plans only the chain of step patches ``have → have+1 → … → want`` (no skips, no
    keyframes): the baseline the folded path is compared with."""

    def plan(
        self,
        run: str,
        have: int | None,
        want: int,
        *,
        avoid: frozenset[str] = frozenset(),
        sources: Mapping[int, str] | None = None,
    ) -> Plan:
        # the chain from ``have``: rewind sources (an engine's own records) are not taken
        if have is None:
            raise NoPathError("a chain of step patches needs a loaded engine", run=run)
        steps = []
        for v in range(have + 1, want + 1):
            m = self.manifest(run, v)
            if m.parent != v - 1 or not m.patches_from(v - 1):
                raise NoPathError("no step patch into this version", run=run, version=v)
            refs = tuple(p.ref for p in m.patches_from(v - 1))
            if any(r.key in avoid for r in refs):
                raise NoPathError("a step patch of the chain is avoided", run=run, version=v)
            steps.append(PlanStep(v - 1, v, refs))
        return Plan(run, have, want, tuple(steps))


def fresh_digest(view: View) -> str:
    """Root digest recomputed from the words (no cached per-tensor digests)."""
    return root_digest({name: t.digest() for name, t in view.items()})


def describe(plan: Plan) -> str:
    """``kf0→16`` (keyframe of 0, then 0→16), ``12→16``, ``0→1→2→…→16``."""
    nodes: list[str] = []
    for s in plan.steps:
        if s.base is None:
            nodes = [f"kf{s.to}"]
            continue
        if not nodes:
            nodes = [str(s.base)]
        nodes.append(str(s.to))
    if len(nodes) > 6:
        nodes = [*nodes[:3], "…", nodes[-1]]
    return "→".join(nodes)


def check(view: View, expected: str, what: str) -> None:
    got = fresh_digest(view)
    if got != expected:
        raise SystemExit(
            f"NOT BIT-EXACT: {what}: replica digest {got[:16]} != publisher's "
            f"view digest {expected[:16]}"
        )


def _sync(follower: Follower, want: int, times: dict[str, float]) -> None:
    t0 = time.perf_counter()
    if follower.sync(want) != want:
        raise SystemExit(f"follower did not reach v{want}")
    times["sync"] += time.perf_counter() - t0
    st = follower.status()
    for k, v in (
        ("fetch", st.last_fetch_s),
        ("stage", st.last_stage_s),
        ("commit", st.last_commit_s),
    ):
        times[k] += v or 0.0


def run(job: dict[str, Any]) -> dict[str, Any]:
    run_name, want, have, path = job["run"], int(job["want"]), job["have"], job["path"]
    expected = {int(k): v for k, v in job["expected"].items()}
    engine = ViewEngine()
    config = FollowerConfig(fetch_workers=job.get("fetch_workers", 4))
    setup_s = 0.0
    if have is not None:  # the publishing process's own view of version ``have``
        t0 = time.perf_counter()
        engine.load(load_view(job["base_view"]), int(have))
        check(engine.view, expected[int(have)], f"setup replica at v{have}")
        engine.view.digest()  # a running engine has its digests from its last commit
        setup_s = time.perf_counter() - t0
    rss_before = current_rss()
    gc.collect()
    reset = reset_peak_rss()

    board = Board(open_store(job["board"], **job.get("board_options", {})))
    follower = Follower(board, run_name, engine, config)
    if path in ("chain", "composed"):
        # the follower plans through its retrying reader; swap in the chain-only planner
        follower._reader = ChainBoard(follower._reader.store)  # bench seam
    times = dict.fromkeys(("sync", "fetch", "stage", "commit"), 0.0)
    plans = []
    targets = range(int(have) + 1, want + 1) if path == "chain" else [want]
    for v in targets:  # chain: one commit per step patch; otherwise one commit in all
        _sync(follower, v, times)
        assert follower.last_plan is not None
        plans.append(follower.last_plan)
    peak = peak_rss()
    if path != "keyframe" and any(s.is_keyframe for p in plans for s in p.steps):
        raise SystemExit(f"{path} plan unexpectedly boots from a keyframe")
    t0 = time.perf_counter()
    check(engine.view, expected[want], f"{path} replica {have}→{want}")
    verify_s = time.perf_counter() - t0
    st = follower.status()
    if st.reboots or st.commits != len(targets):
        raise SystemExit(f"{path}: {st.commits} commits, {st.reboots} reboots")
    board.store.close()
    steps = tuple(s for p in plans for s in p.steps)
    return {
        "ok": True,
        "path": path,
        "have": have,
        "want": want,
        "plan": describe(Plan(run_name, have, want, steps)),
        "hops": len(steps),
        "commits": st.commits,
        "plan_bytes": sum(s.bytes for s in steps),
        "objects": st.objects_fetched,
        "bytes": st.bytes_fetched,
        "sync_s": times["sync"],
        "fetch_s": times["fetch"],
        "stage_s": times["stage"],
        "commit_s": times["commit"],
        "setup_s": setup_s,
        "verify_s": verify_s,
        "rss_before": rss_before,
        "peak_reset": reset,
        "peak": peak,
        "view_bytes": engine.view.nbytes,
    }


def main() -> int:
    job = json.loads(sys.stdin.read())
    out = run(job)
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
