"""Memory budgets, measured: publisher host memory and a follower's, per phase, in clean
child processes. Per phase: the peak of live allocations above the phase's start
(tracemalloc, which sees numpy's buffers: exact, and blind to freed pages the allocator
keeps), and the growth of peak RSS (VmHWM, reset with ``clear_refs``) for reference.

``python bench/fleet.py --memory 100M`` runs it. Versions: :mod:`rollpatch.sim` AdamW steps
(lr 1e-6), BF16 views saved once under ``--work``; a version's masters are its BF16 words
widened to FP32 (their cast is exactly the view).

- **publisher** (one rank, synchronous, ``keyframe_every=3``, no skip patches): the trainer's
  masters are loaded first (the trainer's own weights: the baseline), then each version is
  published and the peak above the baseline recorded. The whole view is the largest rank's
  shard here. Target (issue #14): ≤ 1.5 × that shard. Twice, in the same child: with
  ``snapshot="masters"`` (the FP32 host copy, the path before) on a run of its own, then with
  the default ``snapshot="served"`` (cast tensor by tensor in ``publish()``), then as 4
  sliced ranks (threads, each a dim-0 slice of every tensor: the peak of all four together,
  against 1.5 × the sum of their shards).
- **keyframe write**: ``Board.put_view_object`` (streamed) vs ``put_object(view_to_bytes)``
  (serialized in memory, the path before), the view already in memory (baseline).
- **follower** (ViewEngine, file board): boot from the keyframe (peak above the bare process
  vs the view; streamed ``Board.fetch_view`` vs whole-object fetch), then each patch step
  (peak above the engine's weights vs 2 × the staged patch: the decoded update the engine is
  handed — positions, old and new words, about 12 bytes per change — which is what a follower
  holds between fetch and commit; the coded patch, about 1 byte per change, is printed in the
  phase's row for reference). Targets: boot ≤ view + one tensor (+ 1 MiB of slack for the
  header and bookkeeping); steps ≤ weights + 2 × the decoded update.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from _util import current_rss, peak_rss, reset_peak_rss

HERE = Path(__file__).resolve().parent
RUN = "mem"


def prepare(work: Path, n_params: int, versions: int) -> dict[str, Any]:
    from rollpatch.formats import cast_view
    from rollpatch.io import save_view
    from rollpatch.sim import AdamSim, SimConfig

    meta_path = work / "versions.json"
    key = {"n_params": n_params, "versions": versions}
    if meta_path.exists() and json.loads(meta_path.read_text()).get("key") == key:
        return json.loads(meta_path.read_text())
    work.mkdir(parents=True, exist_ok=True)
    sim = AdamSim(SimConfig(n_params=n_params, lr=1e-6, seed=0))
    view_bytes = 0
    for v in range(versions):
        if v:
            sim.step()
        view = cast_view(sim.masters(), "bf16")
        view_bytes = view.nbytes
        save_view(view, work / f"v{v}.safetensors")
    meta = {"key": key, "view_bytes": view_bytes, "n_params": sim.n_params}
    meta_path.write_text(json.dumps(meta))
    return meta


def _masters_into(work: Path, v: int, out: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Version ``v``'s FP32 masters, written into ``out``'s arrays when given (the trainer's
    weights stay one set of buffers across steps)."""
    from rollpatch.io import load_view

    view = load_view(work / f"v{v}.safetensors", mmap=True)
    if out is None:
        out = {n: np.empty(t.shape, np.float32) for n, t in view.items()}
    for n, t in view.items():  # one tensor's temporary at a time
        np.copyto(out[n], (t.data.astype(np.uint32) << 16).view(np.float32).reshape(t.shape))
    return out


def _phase(fn: Any) -> tuple[Any, dict[str, int], float]:
    """(result, {"traced": peak of live Python/numpy allocations above the start (tracemalloc:
    exact, blind to the allocator keeping freed pages), "rss": peak RSS above the start}, s)."""
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    base_rss = current_rss()
    reset_peak_rss()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t = time.perf_counter()
    out = fn()
    secs = time.perf_counter() - t
    traced = tracemalloc.get_traced_memory()[1] - base
    return out, {"traced": max(traced, 0), "rss": max(peak_rss() - base_rss, 0)}, secs


def child_publisher(work: Path, board: str, versions: int) -> list[dict[str, Any]]:
    from rollpatch.board import Board
    from rollpatch.formats import cast_view
    from rollpatch.io import view_to_bytes
    from rollpatch.publisher import Publisher, PublisherConfig

    rows: list[dict[str, Any]] = []
    masters = _masters_into(work, 0, None)
    for mode, run in (("masters", RUN + "-masters"), ("served", RUN)):
        cfg = PublisherConfig(format="bf16", keyframe_every=3, skip_strides=(), snapshot=mode)
        pub = Publisher(board, run, cfg, asynchronous=False)
        for v in range(versions):
            _masters_into(work, v, masters)
            _, peak, secs = _phase(lambda p=pub: p.publish(masters))
            st = pub.stats.versions[-1]
            rows.append(
                {
                    "phase": f"publish v{v}"
                    + (" (keyframe)" if st.keyframe else "")
                    + (", masters snapshot (before)" if mode == "masters" else ""),
                    "peak": peak,
                    "seconds": secs,
                    "patch_bytes": st.patch_bytes,
                }
            )
        pub.close()
        del pub
    rows += _sliced_publisher(work, board, versions, masters)
    view = cast_view(masters, "bf16")
    b = Board(board)
    _, peak, secs = _phase(lambda: b.put_view_object("kf-streamed", view))
    rows.append({"phase": "keyframe write, streamed", "peak": peak, "seconds": secs})
    _, peak, secs = _phase(lambda: b.put_object("kf-whole", view_to_bytes(view), "safetensors"))
    rows.append({"phase": "keyframe write, serialized (before)", "peak": peak, "seconds": secs})
    return rows


def _sliced_publisher(
    work: Path, board: str, versions: int, masters: dict[str, np.ndarray], ranks: int = 4
) -> list[dict[str, Any]]:
    """``ranks`` publisher ranks (threads of this process, ``ThreadGroup``), each holding a
    dim-0 slice of every tensor (``TensorSlice``), publish each version; the peak is all
    ranks together, so its budget is 1.5 × the sum of the shards (= the view)."""
    import queue
    import threading

    from rollpatch.publisher import Publisher, PublisherConfig, TensorSlice
    from rollpatch.publisher.sharded import ThreadGroup

    group = ThreadGroup(ranks, timeout_s=600)
    cfg = PublisherConfig(format="bf16", keyframe_every=3, skip_strides=())
    inbox: list[queue.Queue[int | None]] = [queue.Queue() for _ in range(ranks)]
    done: queue.Queue[BaseException | None] = queue.Queue()

    def local(r: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, w in masters.items():
            rows = np.array_split(np.arange(w.shape[0]), ranks)[r]
            if rows.size:
                row = int(np.prod(w.shape[1:], dtype=np.int64))
                out[name] = TensorSlice(w[rows[0] : rows[-1] + 1], int(rows[0]) * row, w.shape)
        return out

    def rank_main(r: int) -> None:
        try:
            with Publisher(
                board, RUN + "-sliced", cfg, group=group.member(r), asynchronous=False
            ) as pub:
                while (v := inbox[r].get()) is not None:
                    pub.publish(local(r), v)
                    done.put(None)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            done.put(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()

    def one(v: int) -> None:
        for q in inbox:
            q.put(v)
        for _ in range(ranks):
            err = done.get()
            if err is not None:
                raise err

    rows: list[dict[str, Any]] = []
    for v in range(versions):
        _masters_into(work, v, masters)  # the trainer's weights (the baseline), as above
        _, peak, secs = _phase(lambda v=v: one(v))
        rows.append(
            {"phase": f"publish v{v}, {ranks} sliced ranks (all)", "peak": peak, "seconds": secs}
        )
    for q in inbox:
        q.put(None)
    for t in threads:
        t.join()
    return rows


def child_follower(board: str, versions: int) -> list[dict[str, Any]]:
    from rollpatch.board import Board
    from rollpatch.engines import ViewEngine
    from rollpatch.follower import Follower, FollowerConfig
    from rollpatch.io import view_from_bytes
    from rollpatch.patch import DeltaOp

    rows: list[dict[str, Any]] = []
    b = Board(board)
    kf = b.manifest(RUN, 0).keyframes[0].ref
    got, peak, secs = _phase(lambda: view_from_bytes(b.fetch(kf)))
    rows.append({"phase": "keyframe read, whole object (before)", "peak": peak, "seconds": secs})
    del got
    got, peak, secs = _phase(lambda: b.fetch_view(kf))
    largest = max(t.nbytes for t in got.values())
    rows.append(
        {
            "phase": "keyframe read, streamed",
            "peak": peak,
            "seconds": secs,
            "largest_tensor": largest,
        }
    )
    del got
    engine = ViewEngine()
    updates: list[int] = []
    inner = engine.apply

    def apply(patch: Any, version: int) -> None:  # the decoded update it is handed
        updates.append(
            sum(
                t.change.positions.nbytes + t.change.old.nbytes + t.change.new.nbytes
                for t in patch.tensors.values()
                if isinstance(t.change, DeltaOp)
            )
        )
        inner(patch, version)

    engine.apply = apply  # type: ignore[method-assign]
    f = Follower(b, RUN, engine, FollowerConfig(audit_bytes_per_s=None))
    _, peak, secs = _phase(lambda: f.sync(0))
    rows.append(
        {
            "phase": "follower boot v0 (keyframe)",
            "peak": peak,
            "seconds": secs,
            "largest_tensor": largest,
        }
    )
    for v in range(1, versions):
        m = b.manifest(RUN, v)
        patch = sum(p.ref.size for p in m.patches_from(v - 1))
        _, peak, secs = _phase(lambda v=v: f.sync(v))
        rows.append(
            {
                "phase": f"follower step v{v - 1}→v{v} (coded patch {patch / 1e6:.1f} MB)",
                "peak": peak,
                "seconds": secs,
                "patch_bytes": patch,
                "update_bytes": updates[-1] if updates else 0,
            }
        )
    sliced = Follower(b, RUN + "-sliced", ViewEngine(), FollowerConfig(audit_bytes_per_s=None))
    _, peak, secs = _phase(lambda: sliced.sync(0))  # 4 keyframe shard objects of slices
    rows.append(
        {
            "phase": "follower boot v0 (sliced keyframe, 4 shards)",
            "peak": peak,
            "seconds": secs,
            "largest_tensor": largest,
        }
    )
    return rows


def run(work: Path, n_params: int, versions: int = 4) -> dict[str, Any]:
    """Prepare versions, run both children, return their rows and the view size."""
    import shutil

    meta = prepare(work / "versions", n_params, versions)
    board_dir = work / "board"
    shutil.rmtree(board_dir, ignore_errors=True)
    board = f"file://{board_dir}"
    out: dict[str, Any] = {"view_bytes": meta["view_bytes"], "n_params": meta["n_params"]}
    for role in ("publisher", "follower"):
        cmd = [
            sys.executable,
            str(HERE / "_fleet_memory.py"),
            role,
            str(work / "versions"),
            board,
            str(versions),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
        if r.returncode != 0:
            raise SystemExit(f"memory child {role} failed:\n{r.stderr[-4000:]}")
        out[role] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


if __name__ == "__main__":
    role, work_dir, board_uri, n = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    res = (
        child_publisher(work_dir, board_uri, n)
        if role == "publisher"
        else child_follower(board_uri, n)
    )
    print(json.dumps(res))


def render(res: dict[str, Any]) -> str:
    """The memory table: peak above the phase's baseline, as bytes and × the view."""
    from _util import table

    view = res["view_bytes"]
    rows = []
    for role in ("publisher", "follower"):
        for r in res[role]:
            budget, target = "", ""
            if r["phase"].startswith("publish v"):
                budget, target = f"{1.5 * view / 1e6:.0f} MB", "≤ 1.5× shard"
                if "sliced ranks" in r["phase"]:
                    target = "≤ 1.5× Σ shards"
            elif r["phase"].startswith("follower step"):
                budget, target = f"{2 * r['update_bytes'] / 1e6:.1f} MB", "≤ 2× update"
            elif r["phase"].startswith("follower boot"):
                budget = f"{(view + r['largest_tensor'] + 2**20) / 1e6:.0f} MB"
                target = "≤ view + 1 tensor"
            ok = ""
            peak = r["peak"]["traced"]
            if budget:
                lim = {
                    "≤ 1.5× shard": 1.5 * view,
                    "≤ 1.5× Σ shards": 1.5 * view,
                    "≤ 2× update": 2 * r.get("update_bytes", 0),
                    "≤ view + 1 tensor": view + r.get("largest_tensor", 0) + 2**20,
                }[target]
                ok = "MET" if peak <= lim else "MISSED"
            rows.append(
                [
                    role,
                    r["phase"],
                    f"{peak / 1e6:.1f} MB",
                    f"{peak / view:.2f}x",
                    f"{r['peak']['rss'] / 1e6:.1f} MB",
                    target,
                    budget,
                    ok,
                    f"{r['seconds']:.2f}",
                ]
            )
    return table(
        [
            "side",
            "phase",
            "live peak above baseline",
            "× view",
            "RSS growth",
            "target",
            "budget",
            "",
            "s",
        ],
        rows,
        [False, False, True, True, True, False, True, False, True],
    )
