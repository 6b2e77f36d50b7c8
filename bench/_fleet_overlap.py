"""Validation of the shard overlap: a real follower against the model's arithmetic.

``python bench/fleet.py --overlap 50M`` publishes a few versions of a simulated model
(:mod:`rollpatch.sim`, BF16) from ``ranks`` publisher ranks (threads, ``ThreadGroup``), each
holding a dim-0 slice of every tensor (``TensorSlice``): every version is ``ranks`` shard
objects. A follower (``ViewEngine``) reads the board through an emulated link
(``ThrottledStore``: a round trip per call, a bandwidth cap) and syncs one version at a time,
alternately with the shard objects decoded as they arrive (``EarlyDecode``, the follower
today) and after the last one (the follower before).

For each synced version the same run also measures the parts the model is built from, on
their own: when each object arrives over the link (fetched as the follower fetches them), how
long each object's decode takes, the join + apply + commit after the last object, and the
control plane (plan and manifests over the link). The prediction is the simulator's formula:
``max(arrival, previous decode end) + decode`` per object, then the tail; or, without the
overlap, ``last arrival + all decodes + tail``. Error = predicted / measured − 1.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

RUN = "overlap"


def _publish(board: Any, versions: list[dict[str, np.ndarray]], ranks: int) -> None:
    from rollpatch.publisher import Publisher, PublisherConfig, TensorSlice
    from rollpatch.publisher.sharded import ThreadGroup

    group = ThreadGroup(ranks, timeout_s=600)
    cfg = PublisherConfig(format="bf16", keyframe_every=0, skip_strides=())
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            with Publisher(board, RUN, cfg, group=group.member(r), asynchronous=False) as pub:
                for v, masters in enumerate(versions):
                    local: dict[str, Any] = {}
                    for name, w in masters.items():
                        rows = np.array_split(np.arange(w.shape[0]), ranks)[r]
                        if rows.size:
                            row = int(np.prod(w.shape[1:], dtype=np.int64))
                            part = w[rows[0] : rows[-1] + 1]
                            local[name] = TensorSlice(part, int(rows[0]) * row, w.shape)
                    pub.publish(local, v)
        except BaseException as e:  # noqa: BLE001 (re-raised by the caller)
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _parts(board: Any, slow: Any, engine: Any, v: int) -> dict[str, Any]:
    """The model's inputs for syncing v-1 → v, each measured on its own."""
    from rollpatch.follower.config import FollowerConfig
    from rollpatch.follower.fetch import Retrier, fetch_objects
    from rollpatch.patch import apply
    from rollpatch.replay import decode_object, decode_step

    t = time.perf_counter()
    plan = slow.plan(RUN, v - 1, v)
    m, base = slow.manifest(RUN, v), slow.manifest(RUN, v - 1)
    control = time.perf_counter() - t
    arrivals: dict[str, float] = {}
    t0 = time.perf_counter()
    blobs = fetch_objects(
        slow,
        plan.steps[0].objects,
        Retrier(FollowerConfig(), threading.Event(), lambda e: None),
        lambda ref: arrivals.__setitem__(ref.key, time.perf_counter() - t0),
    )
    words = engine.words()
    decoded, dec_s = {}, []
    for po in m.patches_from(v - 1):
        best = float("inf")
        for _ in range(2):  # best of two: the first pays cold caches the follower does not
            t = time.perf_counter()
            decoded[po.ref.key] = decode_object(m, po, blobs[po.ref.key], words)
            best = min(best, time.perf_counter() - t)
        dec_s.append(best)
    order = [po.ref.key for po in m.patches_from(v - 1)]
    view = words.copy()  # the engine's words stay at v-1 for the sync that follows
    t = time.perf_counter()
    apply(view, decode_step(m, base, dict(blobs), view, decoded))
    tail = time.perf_counter() - t
    del view
    return {
        "control_s": control,
        "arrivals": [arrivals[k] for k in order],
        "decode_s": dec_s,
        "tail_s": tail,
    }


def _predict(p: dict[str, Any], overlap: bool) -> float:
    a, d = np.array(p["arrivals"]), np.array(p["decode_s"])
    if overlap:
        idx = np.argsort(a)
        end = 0.0
        for i in idx:
            end = max(end, a[i]) + d[i]
    else:
        end = float(a.max() + d.sum())
    return p["control_s"] + end + p["tail_s"]


def run(
    work: Path, n_params: int, *, ranks: int = 8, mbps: float = 40.0, rtt_ms: float = 20.0
) -> dict[str, Any]:
    """Publish, then sync versions alternately with and without the overlap."""
    from rollpatch.board import Board
    from rollpatch.engines import ViewEngine
    from rollpatch.follower import Follower, FollowerConfig, stage
    from rollpatch.sim import AdamSim, SimConfig
    from rollpatch.store import FileStore
    from rollpatch.store.throttle import ThrottledStore

    sim = AdamSim(SimConfig(n_params=n_params, lr=1e-6, seed=0))
    versions = [sim.masters()]
    for _ in range(6):
        sim.step()
        versions.append({k: w.copy() for k, w in sim.masters().items()})
    board_dir = work / "overlap-board"
    shutil.rmtree(board_dir, ignore_errors=True)
    board = Board(FileStore(board_dir, fsync=False))
    t = time.perf_counter()
    _publish(board, versions, ranks)
    publish_s = time.perf_counter() - t
    n_params_real = sim.n_params
    del versions, sim
    slow = Board(ThrottledStore(FileStore(board_dir, fsync=False), mbps * 1e6, rtt_ms / 1e3))
    f = Follower(slow, RUN, ViewEngine(), FollowerConfig(audit_bytes_per_s=None))
    f.sync(0)
    rows = []
    real_for_plan = stage.EarlyDecode.for_plan
    for v in range(1, 7):
        overlap = v % 2 == 1
        parts = _parts(board, slow, f.engine, v)
        if not overlap:
            stage.EarlyDecode.for_plan = classmethod(lambda cls, *a: None)  # type: ignore[method-assign,assignment]
        try:
            t = time.perf_counter()
            f.sync(v)
            measured = time.perf_counter() - t
        finally:
            stage.EarlyDecode.for_plan = real_for_plan  # type: ignore[method-assign]
        predicted = _predict(parts, overlap)
        m = board.manifest(RUN, v)
        rows.append(
            {
                "version": v,
                "overlap": overlap,
                "objects": len(m.patches_from(v - 1)),
                "patch_bytes": sum(p.ref.size for p in m.patches_from(v - 1)),
                "measured_s": measured,
                "predicted_s": predicted,
                "error": predicted / measured - 1,
                **{k: parts[k] for k in ("control_s", "tail_s")},
                "last_arrival_s": max(parts["arrivals"]),
                "decode_sum_s": sum(parts["decode_s"]),
            }
        )
        assert f.engine.words().digest() == m.target
    return {
        "n_params": n_params_real,
        "view_bytes": f.engine.words().nbytes,
        "ranks": ranks,
        "mbps": mbps,
        "rtt_ms": rtt_ms,
        "publish_s": publish_s,
        "rows": rows,
    }


def render(res: dict[str, Any]) -> str:
    from _util import table

    body = [
        [
            str(r["version"]),
            "on arrival" if r["overlap"] else "after fetch",
            str(r["objects"]),
            f"{r['patch_bytes'] / 1e6:.2f} MB",
            f"{r['control_s']:.3f}",
            f"{r['last_arrival_s']:.3f}",
            f"{r['decode_sum_s']:.3f}",
            f"{r['tail_s']:.3f}",
            f"{r['measured_s']:.3f}",
            f"{r['predicted_s']:.3f}",
            f"{r['error']:+.1%}",
        ]
        for r in res["rows"]
    ]
    head = [
        "v",
        "decode",
        "objects",
        "patch",
        "control s",
        "last arrival s",
        "decodes s",
        "tail s",
        "measured s",
        "predicted s",
        "error",
    ]
    return table(head, body, [True, False] + [True] * 9)
