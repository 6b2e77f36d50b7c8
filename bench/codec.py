"""Codec benchmark: rollpatch (native and numpy reference) against XOR+zstd baselines.

Run: ``python bench/codec.py`` (defaults below), or e.g.
``python bench/codec.py --sizes 20M --lrs 1e-6,1e-5 --formats bf16 --threads 1 --json out.json``.

**Data.** Consecutive FP32 master versions from :mod:`rollpatch.sim` (AdamW on synthetic
gradients, Adam state pre-warmed to step 1000; see that module for every modelling choice),
served through :func:`rollpatch.formats.cast_view` as BF16, FP8 E4M3 128×128 block and NVFP4
(``scales="bf16"``; embeddings, lm_head and norms stay BF16, as engines serve them). Each
(size, lr) starts a fresh simulator (seed 0) and measures ``steps`` consecutive transitions
for every format; one table row per (size, lr, format, threads) aggregates them.

**What is compared** (the same transition, the same process, the same thread count T):

- *rollpatch native*: ``encode_views(a, b)`` — the fused one-pass native encoder; it holds
  the base view's digests from the previous step, as a publisher does, and derives the new
  view's rp.sum128 from them plus the change of the words it found changed (it compared
  every word). Decode+apply: ``apply_encoded(view, blob)`` — each chunk decoded and written
  in place in one pass that also re-hashes (rp.sum128) every word of a touched tensor as it
  reads it, checked against its target digest, and the root; "rp inc": O(change) updates.
- *rollpatch numpy*: the executable reference (``rollpatch.native.core`` off): ``diff`` +
  ``encode`` and ``decode`` + ``apply`` in numpy; same bytes (checked). Timed at sizes below
  ``--numpy-max`` only (it is the slow reference; "-" above).
- *XOR+zstd-1* (the Stitch encoder's method, modal-projects/miles ``disk_delta.py``): per
  tensor, numpy XOR of old and new words, zstd level 1, xxh3-128 of the new tensor; receive:
  decompress, XOR into the base in place, check the xxh3-128.
- *XOR+zstd-3*: the same at zstd level 3 (what slime/rollpatch's dense fallback use).
- *memcpy*: copying the view into preallocated buffers with T threads (the yardstick).
- *the i.i.d. bound*: ``n·H(k/n) + k·H(d)`` bits (see rollpatch.analysis.bounds).

**MoE** (``--moe 32:4``: experts per MoE layer, top-k): every group simulates a Qwen3-MoE
layout instead (:mod:`rollpatch.sim.moe`: routed experts with skewed routing, a router per
layer), and quantised formats keep the routers (``*.mlp.gate.weight``) in BF16, as MoE
checkpoints quantised for vLLM do; rows are labelled ``SIZE-moeE/K``. Without ``--moe``
nothing changes. bench/moe.py breaks the MoE numbers down (experts vs dense, per expert).

T threads: baselines run tensors on a pool of T; rollpatch runs with ``ROLLPATCH_THREADS=T``
(tensors and chunks of large tensors on T threads). Times are wall clock, best of
``--repeats`` where a view is under 1 GB, best of ``--big-repeats`` (default 1) above. Every decode+apply of every method is
checked bit-exact against the target view; any mismatch aborts the run.

**Memory.** ``enc mem`` is the peak RSS growth during one native encode (VmHWM reset before
it, no earlier patch alive, the C heap trimmed first so that memory an earlier call freed is
not reused unseen) over the two views already resident, in units of the patch size
(target ≤ 2). What a process sets up once and keeps (the header's zstd context, the thread
pool) is measured by a first encode of a small view before any row and printed in the
footer. The payloads are coded into one native buffer in the container's order, which is
copied out after the header while its pages are given back (``native.core.join_release``), so
the payloads and the patch are not both held whole. A row's first encode also pays for the
header's zstd context growing when its header is the largest the process has compressed
(kept for the process afterwards; the footer's small view sets up a small one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import numpy as np
from _baselines import (
    RoundTripError,
    copy_buffers,
    memcpy,
    memcpy_reused,
    restore,
    xor_apply,
    xor_encode,
    xor_undo,
)
from _codec_report import Row, render
from _util import (
    best_of,
    current_rss,
    log,
    machine,
    parse_size,
    peak_rss,
    reset_peak_rss,
    trim_heap,
)

from rollpatch import native
from rollpatch.analysis.bounds import BoundAccumulator
from rollpatch.errors import PatchError
from rollpatch.formats import QuantPolicy, cast_view
from rollpatch.kinds import KINDS
from rollpatch.patch import apply, apply_encoded, decode, diff, encode, encode_views
from rollpatch.sim import AdamSim, MoEConfig, SimConfig
from rollpatch.view import Tensor, View

DEFAULT_FORMATS = "bf16,fp8-e4m3-block128,nvfp4"
ONE_RUN_ABOVE = 1 << 30  # views larger than this are timed --big-repeats times


# -- the i.i.d. bound (shared with `rollpatch analyze`: rollpatch.analysis.bounds) ----------


def bound_bits(a: View, b: View) -> tuple[int, int, float]:
    """(elements, changed, whole-view i.i.d. bound bits), one tensor's diff at a time (the
    whole decoded patch at 1B, lr 1e-5 would not fit beside the simulator)."""
    acc = BoundAccumulator()
    for name in a:
        p = diff(View({name: a[name]}), View({name: b[name]}))
        try:
            acc.add(name, a[name].n_elements, p.tensors.get(name))
        except PatchError as e:
            raise RoundTripError(f"unexpected op in a same-layout diff: {e}") from None
    return acc.n, acc.k, acc.whole_bits()


# -- one transition ---------------------------------------------------------------------------


def _check_equal(got: View, want: View, what: str) -> None:
    if sorted(got) != sorted(want) or any(
        not np.array_equal(got[n].data, want[n].data) for n in want
    ):
        raise RoundTripError(f"{what}: decode+apply is not bit-exact")


def transition(
    a: View, b: View, rows: dict[int, Row], repeats: int, numpy_ref: bool, big_repeats: int = 1
) -> None:
    """Measure a → b at every thread count; ``a`` and ``b`` are left unchanged."""
    big = a.nbytes > ONE_RUN_ABOVE
    reps = big_repeats if big else repeats
    a.digest()  # a publisher holds the base digests from the previous step
    # above 1 GB there is no room for a third view beside the simulator: measurements run in
    # place on the base and put it back (rollpatch with the inverse patch, XOR by itself)
    work = a if big else a.copy()
    scratch = {n: np.empty_like(a[n].data) for n in a} if not big else None
    inverse = encode_views(b, a) if big else b""
    blob = b""
    for threads, row in rows.items():
        os.environ["ROLLPATCH_THREADS"] = str(threads)
        with ThreadPoolExecutor(threads) as pool:
            if scratch is None:  # one buffer of the largest tensor's size per thread, reused
                bufs = copy_buffers(a, threads)
                t_mc, _ = best_of(lambda: memcpy_reused(a, bufs, pool), reps)  # noqa: B023
                del bufs
            else:
                t_mc, _ = best_of(lambda: memcpy(a, scratch, pool), reps)

            def enc() -> bytes:
                b.invalidate()
                return encode_views(a, b)

            # memory: one encode with no earlier result alive (best_of keeps the last one), on a
            # trimmed heap (every page it touches counts, whatever ran before)
            blob = b""
            trim_heap()
            reset_peak_rss()
            rss0 = current_rss()
            blob = enc()
            extra = max(0, peak_rss() - rss0)
            t_enc, blob = best_of(enc, reps)
            t_dec = t_inc = math.inf
            for _ in range(reps):
                for inc in (False, True):
                    restore(work, a)
                    t, _ = best_of(lambda: apply_encoded(work, blob, incremental=inc), 1)  # noqa: B023
                    if inc:
                        t_inc = min(t_inc, t)
                    else:
                        t_dec = min(t_dec, t)
                    _check_equal(work, b, "rollpatch native")
                    if work.digest() != b.digest():
                        raise RoundTripError("rollpatch: root digest differs after apply")
                    if big:
                        apply_encoded(work, inverse)
            t_nenc = t_ndec = math.nan
            if numpy_ref:
                core, native.core = native.core, None
                try:

                    def nenc() -> bytes:
                        b.invalidate()
                        return encode(diff(a, b), a)

                    t_nenc, nblob = best_of(nenc, reps)
                    if nblob != blob:
                        raise RoundTripError("numpy reference and native bytes differ")
                    restore(work, a)
                    t_ndec, _ = best_of(lambda: apply(work, decode(blob, work)), 1)  # noqa: B023
                    _check_equal(work, b, "rollpatch numpy")
                    if big:
                        apply(work, decode(inverse, work))
                finally:
                    native.core = core
            xs: dict[int, tuple[float, float, int]] = {}
            for level in (1, 3):
                t_xe, frames = best_of(lambda: xor_encode(a, b, pool, level), reps)  # noqa: B023
                t_xd = math.inf
                for _ in range(reps):
                    restore(work, a)
                    t, _ = best_of(lambda: xor_apply(work, frames, pool), 1)  # noqa: B023
                    t_xd = min(t_xd, t)
                    _check_equal(work, b, f"XOR+zstd-{level}")
                    if big:
                        xor_undo(work, frames)
                        work.invalidate()
                xs[level] = (t_xe, t_xd, sum(len(f) for f, _ in frames.values()))
        row.transitions += 1
        row.view_bytes += a.nbytes
        row.patch_bytes += len(blob)
        row.xor1_bytes += xs[1][2]
        row.xor3_bytes += xs[3][2]
        for m, e, d in (
            ("native", t_enc, t_dec),
            ("inc", math.nan, t_inc),
            ("numpy", t_nenc, t_ndec),
            ("xor1", xs[1][0], xs[1][1]),
            ("xor3", xs[3][0], xs[3][1]),
            ("memcpy", t_mc, t_mc),
        ):
            row.enc_s[m] += e
            row.dec_s[m] += d
        row.enc_extra = max(row.enc_extra, extra)
        row.per_step.append(
            {
                "view_bytes": a.nbytes,
                "patch_bytes": len(blob),
                "xor1_bytes": xs[1][2],
                "xor3_bytes": xs[3][2],
                "enc_s": {"native": t_enc, "numpy": t_nenc, "xor1": xs[1][0], "xor3": xs[3][0]},
                "dec_s": {
                    "native": t_dec,
                    "inc": t_inc,
                    "numpy": t_ndec,
                    "xor1": xs[1][1],
                    "xor3": xs[3][1],
                },
                "memcpy_s": t_mc,
                "enc_extra_bytes": extra,
            }
        )
    n, k, whole = bound_bits(a, b)
    for row in rows.values():
        row.elements += n
        row.changed += k
        row.bound_bits += whole


def first_encode_rss(threads: Sequence[int]) -> int:
    """Peak RSS growth of the process's first encodes of a small view (one per thread count):
    what a process sets up once and keeps (the header's level-9 zstd context per encoding
    thread, ~0.9 MB; the core's thread pool), measured here so that no row is charged with it."""
    rng = np.random.default_rng(0)
    n = 1 << 16
    a = View({"w": Tensor(KINDS["bf16"], (n,), rng.integers(0, 1 << 16, n, dtype=np.uint16))})
    b = a.copy()
    b["w"].data[::97] ^= 1
    b.invalidate()
    trim_heap()
    reset_peak_rss()
    rss0 = current_rss()
    for t in threads:
        os.environ["ROLLPATCH_THREADS"] = str(t)
        b.invalidate()
        encode_views(a, b)
    return max(0, peak_rss() - rss0)


def run_group(
    size: str,
    n_params: int,
    lr: float,
    formats: Sequence[str],
    steps: int,
    repeats: int,
    threads: Sequence[int],
    numpy_ref: bool,
    moe: MoEConfig | None = None,
    big_repeats: int = 1,
) -> tuple[list[Row], dict[str, Any]]:
    """Fresh simulator at (size, lr); ``steps`` transitions for every format."""

    t0 = time.perf_counter()
    sim = AdamSim(SimConfig(n_params=n_params, lr=lr, seed=0, moe=moe))
    policy = QuantPolicy(exclude=("*.mlp.gate.weight",)) if moe else None
    info: dict[str, Any] = {
        "size": size,
        "lr": lr,
        "n_params": sim.n_params,
        "dims": asdict(sim.dims),
        "init_s": time.perf_counter() - t0,
        "step_s": [],
        "cast_s": {},
    }
    log(f"{size} lr={lr:g}: simulator {sim.n_params:,} params in {info['init_s']:.1f}s")
    rows = {f: {t: Row(size, sim.n_params, lr, f, t) for t in threads} for f in formats}
    base = {}
    for f in formats:
        t0 = time.perf_counter()
        base[f] = cast_view(sim.masters(), f, scales="bf16", policy=policy)
        info["cast_s"][f] = time.perf_counter() - t0
    for s in range(steps):
        t0 = time.perf_counter()
        sim.step()
        info["step_s"].append(time.perf_counter() - t0)
        log(f"{size} lr={lr:g}: step {s + 1} in {info['step_s'][-1]:.1f}s")
        for f in formats:
            target = cast_view(sim.masters(), f, scales="bf16", policy=policy)
            transition(base[f], target, rows[f], repeats, numpy_ref, big_repeats)
            base[f] = target
            r = rows[f][threads[0]]
            log(
                f"  {f}: {100 * r.changed / r.elements:.3f}% changed, patch "
                f"{100 * r.patch_bytes / r.view_bytes:.3f}% of the view"
            )
    peak = peak_rss()
    out = [r for f in formats for r in rows[f].values()]
    for r in out:
        r.peak_rss = peak
    del sim, base
    return out, info


# -- report -----------------------------------------------------------------------------------


def _steps_for(text: str, n_sizes: int) -> list[int]:
    steps = [int(s) for s in text.split(",")]
    if len(steps) == 1:
        steps *= n_sizes
    if len(steps) != n_sizes or any(s < 1 for s in steps):
        raise SystemExit("--steps: one positive int, or one per size")
    return steps


def _moe_arg(text: str | None) -> MoEConfig | None:
    if text is None:
        return None
    try:
        e, k = (int(x) for x in text.split(":"))
        return MoEConfig(experts=e, top_k=k)
    except ValueError as err:
        raise SystemExit(f"--moe: E:K, e.g. 32:4 ({err})") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100M,1B", help="parameter counts, e.g. 20M,100M,1B")
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="AdamW learning rates")
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help="served formats")
    ap.add_argument(
        "--steps", default="2,1", help="transitions per (size, lr): one int, or one per size"
    )
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats for views < 1 GB")
    ap.add_argument(
        "--big-repeats", type=int, default=1, help="timing repeats for views of 1 GB and more"
    )
    ap.add_argument("--threads", default="1,2", help="thread counts to measure")
    ap.add_argument("--numpy-max", default="200M", help="time the numpy reference up to this size")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    ap.add_argument("--moe", default=None, metavar="E:K", help="simulate an MoE: E experts, top-K")
    args = ap.parse_args(argv)
    moe = _moe_arg(args.moe)

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    lrs = [float(x) for x in args.lrs.split(",")]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    steps = _steps_for(args.steps, len(sizes))
    mach = machine()
    load0 = mach["loadavg_1m"] or 0.0
    t_start = time.perf_counter()
    rows: list[Row] = []
    sims: list[dict[str, Any]] = []
    threads = [int(t) for t in args.threads.split(",")]
    if native.core is None:
        raise SystemExit("the native core is not built: pip install -e .")
    mach["first_encode_rss"] = first_encode_rss(threads)
    for size, n_steps in zip(sizes, steps):
        for lr in lrs:
            n = parse_size(size)
            got, info = run_group(
                f"{size}-moe{moe.experts}/{moe.top_k}" if moe else size,
                n,
                lr,
                formats,
                n_steps,
                args.repeats,
                threads,
                n <= parse_size(args.numpy_max),
                moe,
                max(1, args.big_repeats),
            )
            rows += got
            sims.append(info)
            log(
                "rows so far:\n" + render(rows, mach, time.perf_counter() - t_start, (load0, load0))
            )
            if args.json:  # written after every group: a long run keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(
                        {
                            "args": vars(args),
                            "machine": mach,
                            "partial": True,
                            "rows": [asdict(r) for r in rows],
                        },
                        f,
                        indent=1,
                    )
    wall = time.perf_counter() - t_start
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    print(render(rows, mach, wall, (load0, load1)))
    if args.json:
        out = {
            "args": vars(args),
            "machine": mach,
            "wall_s": wall,
            "loadavg_end": load1,
            "simulators": sims,
            "rows": [asdict(r) for r in rows],
            "process_peak_rss": peak_rss(),
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
