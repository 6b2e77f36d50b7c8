"""Elastic join: an engine that booted from a published version's checkpoint, brought to LATEST
by a follower that boots it from a keyframe (``boot="keyframe"``, the default) or adopts the
version it holds (``boot="adopt"``: docs/follower.md, *Adopting a booted engine*).

One run: a Llama-shaped model (``--hidden``, ``--layers``) under warm AdamW (bench/_util.py
``WarmAdamW``), ``--versions`` versions after v0 published on a directory board (v0 the only
keyframe, step patches), and each version's checkpoint as a model directory
(bench/_vllm_world.py). For an engine booted from v0 and one booted from LATEST, each way
(alternated, ``--repeats`` times, a fresh built-in engine each time, its start not counted):
the wall time of ``Follower.sync()`` to LATEST and its phases as the follower reports them
(fetch, stage, the commit's pause; *other*: the rest — planning, manifests, the adoption's
hashes), the bytes and objects it fetched, and the plan.
Beside them, on the same engine: ``boot_digest()`` alone (the O(model) hash an adoption pays)
and a memcpy of the view (the yardstick). *at 1 Gb/s* is arithmetic, not a measurement: the
fetched bytes at 125 MB/s, what they would add over a 1 Gbit/s link to a remote board (the
directory board here is page-cached).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _util import log, machine, machine_line, table
from _vllm_world import RUN, World, add_world_args, model_dims

from rollpatch.follower import Follower, FollowerConfig

#: Bytes per second of the link the *at 1 Gb/s* column assumes.
LINK = 125e6


def _engine(model: Path) -> Any:
    from rollpatch.engines.reference import ReferenceEngine

    return ReferenceEngine.from_dir(model, threads=1, serve_http=False)


def _plan(plan: Any) -> str:
    """``keyframe v0 + 5 patches``, ``5 patches from v0``, or ``nothing to fetch``."""
    if plan is None or not plan.steps:
        return "nothing to fetch"
    patches = sum(1 for s in plan.steps if not s.is_keyframe)
    if plan.steps[0].is_keyframe:
        return f"keyframe v{plan.steps[0].to} + {patches} patches"
    return f"{patches} patches from v{plan.have}"


def _ms(runs: list[dict[str, Any]], key: str) -> str:
    """The median of ``key`` over ``runs`` in ms; ``-`` where the sync had no such phase."""
    got = [x[key] for x in runs if x[key] is not None]
    return f"{statistics.median(got) * 1e3:.0f} ms" if got else "-"


def _other(run: dict[str, Any]) -> float:
    """A sync's time outside fetch, stage and pause: planning, manifests, the adoption."""
    return float(run["s"]) - sum(run[k] or 0.0 for k in ("fetch_s", "stage_s", "pause_s"))


def _join(world: World, booted: int, boot: str) -> dict[str, Any]:
    eng = _engine(world.checkpoint(booted))
    try:
        config = FollowerConfig(boot=boot)  # type: ignore[arg-type]
        f = Follower(world.board, RUN, eng, config)
        t0 = time.perf_counter()
        got = f.sync()
        wall = time.perf_counter() - t0
        st, plan = f.status(), f.last_plan
        if got != len(world.digests) - 1 or eng.digest != world.digests[-1]:
            raise SystemExit(f"join from v{booted} ({boot}) did not end on LATEST")
        return {
            "booted": booted,
            "boot": boot,
            "s": wall,
            "bytes": st.bytes_fetched,
            "objects": st.objects_fetched,
            "adopted": st.adoptions,
            "fetch_s": st.last_fetch_s,
            "stage_s": st.last_stage_s,
            "pause_s": st.last_commit_s,
            "plan": _plan(plan),
        }
    finally:
        eng.close()


def _yardsticks(world: World) -> dict[str, float]:
    eng = _engine(world.checkpoint(0))
    try:
        hashes, copies = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            eng.boot_digest()
            hashes.append(time.perf_counter() - t0)
            for t in eng.runtime.view.values():
                dst = np.empty_like(t.data)
                t1 = time.perf_counter()
                np.copyto(dst, t.data)
                copies.append((t.data.nbytes, time.perf_counter() - t1))
        nbytes = sum(t.data.nbytes for t in eng.runtime.view.values())
        per_copy = sum(s for _, s in copies) / 3
        return {"view_bytes": nbytes, "hash_s": min(hashes), "memcpy_s": per_copy}
    finally:
        eng.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_world_args(ap, versions=5, hidden=1024, layers=8)
    ap.add_argument("--repeats", type=int, default=3, help="joins per case (default 3)")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    info = machine()
    with tempfile.TemporaryDirectory(prefix="rollpatch-join-") as tmp:
        log(f"publishing v0..v{args.versions} (hidden {args.hidden}, {args.layers} layers)")
        world = World(Path(tmp), args.lr, args.versions, model_dims(args.hidden, args.layers))
        last = len(world.digests) - 1
        cases = [(b, m) for b in (0, last) for m in ("keyframe", "adopt")]
        runs: list[dict[str, Any]] = []
        for r in range(args.repeats):
            for booted, boot in cases if r % 2 == 0 else cases[::-1]:
                log(f"join {r + 1}/{args.repeats}: booted v{booted}, boot={boot}")
                runs.append(_join(world, booted, boot))
                gc.collect()
        yard = _yardsticks(world)
    rows = []
    for booted, boot in cases:
        got = [x for x in runs if x["booted"] == booted and x["boot"] == boot]
        s = statistics.median(x["s"] for x in got)
        b = got[0]["bytes"]
        rows.append(
            [
                f"booted v{booted}, boot={boot}",
                str(len(got)),
                f"{s * 1e3:.0f} ms",
                _ms(got, "fetch_s"),
                _ms(got, "stage_s"),
                _ms(got, "pause_s"),
                f"{statistics.median(_other(x) for x in got) * 1e3:.0f} ms",
                f"{b / 1e6:.2f} MB",
                str(got[0]["objects"]),
                f"{(s + b / LINK) * 1e3:.0f} ms",
                got[0]["plan"],
            ]
        )
    print(
        f"elastic join to v{last}: {world.params / 1e6:.0f}M params "
        f"(BF16 view {yard['view_bytes'] / 1e6:.0f} MB), lr {args.lr:g}, "
        f"changed per step {statistics.mean(world.changed[1:]) * 100:.2f}%"
    )
    print(
        table(
            ["case", "n", "sync p50", "fetch", "stage", "pause", "other", "fetched", "objects"]
            + ["at 1 Gb/s", "plan"],
            rows,
            [False, *[True] * 9, False],
        )
    )
    print(
        f"boot_digest (the adoption's hash): {yard['hash_s'] * 1e3:.0f} ms; memcpy of the "
        f"view: {yard['memcpy_s'] * 1e3:.0f} ms; {machine_line(info)}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"runs": runs, "yardsticks": yard, "machine": info}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
