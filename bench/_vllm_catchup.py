"""bench/vllm.py's catch-up arithmetic: what staging a lag of k versions costs, by plan.

The catch-up rows of bench/vllm.py time the one path the board plans (k step patches, no skip
patch published) end to end, on a shared machine. This part says where that time goes and
what another plan would cost, as CPU time in this process (``time.process_time``, native
threads set to 1, plans alternated, min of ``reps``), staging the same lag on the built-in
engine's path: :func:`rollpatch.engines.catchup.decode_in_place` (each step decoded into a
copy of each touched tensor, the composed change taken by a compare) then
:func:`rollpatch.engines.staged.stage_patch` (the proof, O(changed)). Plans:

- **1 behind**: the last step alone (v(k-1) → vk), the denominator;
- **k steps**: v0 → v1 → … → vk, the board's plan without skip patches (the catch-up row);
- **skip + step**: one patch v0 → v(k-1) (what a skip stride of k-1 publishes) and the last
  step;
- **folded**: one patch v0 → vk (what a skip patch landing exactly on vk would be).

Skip and folded patches are encoded here (``encode(diff(...))``), not published; so is the
*floor* patch, random ±1-word changes at 0.02% of the words (the decoder's join with almost
no block holding a change: its cost per word). Then the decode's parts, timed one by one doing
what ``decode_in_place`` does per tensor (the scratch copy, ``decode_into`` per step, the
compare): the k steps' chain, and alone the last step, the skip patch and the folded patch;
a least-squares fit over those patches' decodes gives *J* per patch decoded (the join over
every word) and *c* per change record (docs/engines.md, *What a catch-up costs*).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from _util import table

from rollpatch.engines.catchup import Changes, decode_in_place, step_entries
from rollpatch.engines.staged import stage_patch
from rollpatch.io.safetensors import load_view
from rollpatch.patch import diff, encode, inspect
from rollpatch.patch.codec_v2 import CtxGolombV2
from rollpatch.patch.differ import changes
from rollpatch.view import Tensor, View

#: Share of the words the floor patch changes (few blocks of 256 words hold a change).
FLOOR = 2e-4


def _sparse(view: View, share: float) -> View:
    """``view`` with ``share`` of its words moved by ±1 (random, seeded), packed kinds kept."""
    rng = np.random.default_rng(0)
    out = {}
    for name, t in view.items():
        data = t.data.copy()
        if not t.kind.packed:
            at = np.flatnonzero(rng.random(data.size) < share)
            step = np.where(rng.random(at.size) < 0.5, 1, -1).astype(data.dtype)
            data[at] += step
        out[name] = Tensor(t.kind, t.shape, data)
    return View(out)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Native threads = 1 while measuring (CPU time then excludes thread-pool waits)."""
    old = os.environ.get("ROLLPATCH_THREADS")
    os.environ["ROLLPATCH_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ROLLPATCH_THREADS", None)
        else:
            os.environ["ROLLPATCH_THREADS"] = old


def _parts(
    live: View, chain: list[dict[str, str]], blobs: list[bytes], reps: int
) -> dict[str, Any]:
    """``decode_in_place``'s work on ``live`` timed by part (CPU ms, min over ``reps`` each):
    the scratch copy of every touched tensor, each step's ``decode_into`` (with its change
    records), the compare of the copy with the live words (chains only)."""
    entries = step_entries(chain, [[b] for b in blobs])
    if entries is None:
        raise RuntimeError("the catch-up path did not take the in-place decoder")
    by_name: dict[str, list[Any]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e)
    buf = np.empty(max(live[n].nbytes for n in by_name), np.uint8)
    codec = CtxGolombV2()  # the in-place decoder's codec
    copy, compare, steps = [], [], []
    for _ in range(reps):
        c = m = 0.0
        per = [0.0] * len(chain)
        arena = Changes()  # the engine's: one per thread and catch-up
        for name, es in by_name.items():
            t = live[name]
            t0 = time.process_time()
            work = buf[: t.nbytes].view(t.data.dtype)
            np.copyto(work, t.data)
            c += time.process_time() - t0
            w = Tensor(t.kind, t.shape, work)
            for e in es:
                t0 = time.process_time()
                codec.decode_into(e.payload, w, e.changed)
                per[e.step] += time.process_time() - t0
            if len(es) > 1:
                t0 = time.process_time()
                changes(t, w, empty=arena.empty, trim=arena.trim)
                m += time.process_time() - t0
        copy.append(c)
        compare.append(m)
        steps.append(per)
    records = [sum(e.changed for e in entries if e.step == i) for i in range(len(chain))]
    return {
        "copy_ms": 1e3 * min(copy),
        "compare_ms": 1e3 * min(compare),
        "steps": [
            {"records": r, "ms": 1e3 * min(p[i] for p in steps)} for i, r in enumerate(records)
        ],
    }


def catchup_plans(
    checkpoint: Callable[[int], Any],
    digests: list[str],
    step_blob: Callable[[int], bytes],
    k: int,
    *,
    reps: int = 3,
) -> dict[str, Any]:
    """CPU ms of staging the lag v0 → vk along each plan (module docstring), with each plan's
    patches, change records and bytes; ``checkpoint(v)``: the directory of version v."""
    if k < 2:
        return {}
    views: dict[int, View] = {
        v: load_view(checkpoint(v) / "model.safetensors") for v in (0, k - 1, k)
    }
    skip = encode(diff(views[0], views[k - 1]), views[0])
    folded = encode(diff(views[0], views[k]), views[0])
    sparse = _sparse(views[0], FLOOR)
    floor = encode(diff(views[0], sparse), views[0])
    steps = {v: step_blob(v) for v in range(1, k + 1)}
    names = {**dict(enumerate(digests)), -1: sparse.digest()}

    def spec(path: list[int]) -> list[dict[str, str]]:
        return [{"base": names[a], "target": names[b]} for a, b in itertools.pairwise(path)]

    plans: dict[str, tuple[Any, list[dict[str, str]], list[bytes]]] = {
        "1 behind": (views[k - 1], spec([k - 1, k]), [steps[k]]),
        f"{k} steps": (views[0], spec(list(range(k + 1))), [steps[v] for v in range(1, k + 1)]),
        "skip + step": (views[0], spec([0, k - 1, k]), [skip, steps[k]]),
        "folded": (views[0], spec([0, k]), [folded]),
        f"floor: {100 * FLOOR:g}% random": (views[0], spec([0, -1]), [floor]),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in plans}
    with _one_thread():
        for _ in range(reps):
            for name, (live, chain, blobs) in plans.items():
                t0 = time.process_time()
                out = decode_in_place(live, chain, [[b] for b in blobs], live.sum_state)
                t1 = time.process_time()
                if out is None:
                    raise RuntimeError("the catch-up path did not take the in-place decoder")
                patch, known = out
                stage_patch(
                    patch, live.__getitem__, live.tensor_digests(), live.sum_state, known=known
                )
                times[name].append((t1 - t0, time.process_time() - t1))
    rows = {}
    for name, (_, chain, blobs) in plans.items():
        ts = times[name]
        rows[name] = {
            "patches": len(blobs),
            "records": sum(inspect(b).n_changed for b in blobs),
            "bytes": sum(len(b) for b in blobs),
            "decode_ms": 1e3 * min(t[0] for t in ts),
            "prove_ms": 1e3 * min(t[1] for t in ts),
            "total_ms": 1e3 * min(t[0] + t[1] for t in ts),
        }
    with _one_thread():
        parts = {
            f"{k} steps": _parts(views[0], *plans[f"{k} steps"][1:], reps),
            "1 behind": _parts(views[k - 1], *plans["1 behind"][1:], reps),
            f"skip v0->v{k - 1}": _parts(views[0], spec([0, k - 1]), [skip], reps),
            "folded": _parts(views[0], *plans["folded"][1:], reps),
        }
    words = sum(t.n_elements for t in views[0].values())
    return {"k": k, "plans": rows, "parts": parts, "words": words}


def render_plans(res: dict[str, Any]) -> str:
    """The table, and the per-patch / per-record fit from the single-patch plans."""
    if not res:
        return ""
    plans, k = res["plans"], res["k"]
    one = plans["1 behind"]
    rows = [
        [
            name,
            str(p["patches"]),
            f"{p['records']:,}",
            f"{p['bytes'] / 1e3:.0f} kB",
            f"{p['decode_ms']:.1f}",
            f"{p['prove_ms']:.1f}",
            f"{p['total_ms']:.1f}",
            f"{p['total_ms'] / one['total_ms']:.2f}x",
        ]
        for name, p in plans.items()
    ]
    out = table(
        [
            f"catch-up v0->v{k}, plan",
            "patches",
            "change records",
            "bytes",
            "decode",
            "prove",
            "total",
            "/ 1 behind",
        ],
        rows,
        [False] + [True] * 7,
    )
    return out + "\n" + _render_parts(res, plans[f"floor: {100 * FLOOR:g}% random"])


def _render_parts(res: dict[str, Any], floor: dict[str, Any]) -> str:
    """The decode by part, and the fit of a patch's decode to J + c * records."""
    k, parts, words = res["k"], res["parts"], res["words"]
    chain = parts[f"{k} steps"]
    rows = [["copy (once per catch-up)", "", f"{chain['copy_ms']:.1f}", "", ""]]
    points = []
    for name, p in parts.items():
        for i, st in enumerate(p["steps"]):
            label = f"{k} steps: v{i}->v{i + 1}" if name == f"{k} steps" else name
            points.append((st["records"], st["ms"]))
            rows.append(
                [
                    label,
                    f"{st['records']:,}",
                    f"{st['ms']:.1f}",
                    f"{1e6 * st['ms'] / words:.2f}",
                    f"{1e6 * st['ms'] / max(1, st['records']):.1f}",
                ]
            )
    rows.append([f"{k} steps: compare", "", f"{chain['compare_ms']:.1f}", "", ""])
    out = table(
        ["decode by part (CPU ms)", "change records", "ms", "ns/word", "ns/record"],
        rows,
        [False] + [True] * 4,
    )
    x = np.array([r for r, _ in points], dtype=np.float64)
    y = np.array([m for _, m in points], dtype=np.float64)
    c, j = np.polyfit(x, y, 1)
    low = floor["decode_ms"]
    return out + (
        f"\nCPU ms, one thread, min of the runs (the built-in engine's staging: decode_in_place +"
        f" stage_patch; parts timed as it runs them); skip, folded and floor patches encoded here,"
        f" not published. Fit over the {len(points)} patch decodes: {j:.1f} ms per patch"
        f" ({1e6 * j / words:.2f} ns per word) + {c * 1e6:.1f} ns per change record; the floor"
        f" patch ({100 * FLOOR:g}% of the words, {floor['records']:,} records) decodes in"
        f" {low:.1f} ms with its copy: {1e6 * (low - chain['copy_ms']) / words:.2f} ns per word"
    )
