"""bench/codec.py's measurement of one transition a → b (encode, decode+apply, the XOR+zstd
baselines and memcpy at every thread count, the encode's memory, the i.i.d. bound), and the
process's one-time encode state; bench/codec.py drives the simulator and prints the table."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

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
from _codec_report import Row
from _util import best_of, current_rss, peak_rss, reset_peak_rss, trim_heap

from rollpatch import native
from rollpatch.analysis.bounds import BoundAccumulator
from rollpatch.errors import PatchError
from rollpatch.kinds import KINDS
from rollpatch.patch import apply, apply_encoded, decode, diff, encode, encode_views
from rollpatch.view import Tensor, View

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

            def enc() -> bytes:
                b.invalidate()
                return encode_views(a, b)

            # memory: the row's first encode (with what this process sets up for the row once:
            # the header's zstd context grown to its size, the C heap's first use of this
            # thread count), then one after the timed encodes (what a publisher pays per
            # version); each with no earlier result alive, on a trimmed heap (every page it
            # touches counts, whatever ran before)
            blob = b""
            first = _encode_rss(enc)
            blob = enc()
            frames = {level: xor_encode(a, b, pool, level) for level in (1, 3)}
            t, per_round = _rounds(_methods(a, b, work, scratch, pool, blob, inverse, frames), reps)
            # the same round's rollpatch and XOR+zstd-1 times, paired: their ratio's spread
            # over the rounds says how far one row's best-of ratio can be trusted
            for key, rp_m, x_m in (("enc", "rp enc", "xor1 enc"), ("dec", "rp", "xor1")):
                row.round_ratios[key] += [r[rp_m] / r[x_m] for r in per_round]
            if scratch is None:  # one buffer of the largest tensor's size per thread, reused
                bufs = copy_buffers(a, threads)
                t["memcpy"], _ = best_of(lambda: memcpy_reused(a, bufs, pool), reps)  # noqa: B023
                del bufs
            t_nenc = t_ndec = math.nan
            if numpy_ref:
                t_nenc, t_ndec = _numpy_reference(a, b, work, blob, inverse, reps)
            xs = {lv: (t[f"xor{lv} enc"], t[f"xor{lv}"], _frame_bytes(frames[lv])) for lv in (1, 3)}
            patch_len, blob = len(blob), b""
            del frames
            extra = _encode_rss(enc)
            t_enc, t_dec, t_inc, t_mc = t["rp enc"], t["rp"], t["rp inc"], t["memcpy"]
        row.transitions += 1
        row.view_bytes += a.nbytes
        row.patch_bytes += patch_len
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
        row.enc_first = max(row.enc_first, first)
        row.per_step.append(
            {
                "view_bytes": a.nbytes,
                "patch_bytes": patch_len,
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
                "enc_first_bytes": first,
            }
        )
    n, k, whole = bound_bits(a, b)
    for row in rows.values():
        row.elements += n
        row.changed += k
        row.bound_bits += whole


def _frame_bytes(frames: dict[str, tuple[bytes, bytes]]) -> int:
    return sum(len(f) for f, _ in frames.values())


def _rounds(
    methods: dict[str, Callable[[], float]], reps: int
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Each method's best time over ``reps`` rounds. Every round runs every method once, in an
    order rotated each round, so that a slow spell of this shared machine hits the methods
    alike (timing each method's repeats back to back let a spell land on one method only:
    single ratios swung by 0.2-0.4 between runs). Also every round's times, for paired ratios."""
    names = list(methods)
    best = dict.fromkeys(names, math.inf)
    rounds: list[dict[str, float]] = []
    for r in range(max(1, reps)):
        k = r % len(names)
        got = {}
        for m in names[k:] + names[:k]:
            got[m] = methods[m]()
            best[m] = min(best[m], got[m])
        rounds.append(got)
    return best, rounds


def _methods(
    a: View,
    b: View,
    work: View,
    scratch: dict[str, np.ndarray] | None,
    pool: ThreadPoolExecutor,
    blob: bytes,
    inverse: bytes,
    frames: dict[int, dict[str, tuple[bytes, bytes]]],
) -> dict[str, Callable[[], float]]:
    """One timed run of each method (seconds), with its check; ``work`` holds ``a``'s words
    before and after each (in place above 1 GB: each run puts the base back itself). memcpy
    with ``scratch`` (below 1 GB; above it, no buffers are held through the rounds)."""
    big = work is a
    sums = {n: a.sum_state(n) for n in a} if big else {}

    def timed(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def rp_enc() -> float:
        b.invalidate()
        t0 = time.perf_counter()
        got = encode_views(a, b)
        t = time.perf_counter() - t0
        if got != blob:
            raise RoundTripError("rollpatch: two encodes of one transition differ")
        return t

    def rp_dec(inc: bool) -> float:
        restore(work, a)
        t = timed(lambda: apply_encoded(work, blob, incremental=inc))
        _check_equal(work, b, "rollpatch native")
        if work.digest() != b.digest():
            raise RoundTripError("rollpatch: root digest differs after apply")
        if big:
            apply_encoded(work, inverse)
        return t

    def xor_dec(level: int) -> float:
        restore(work, a)
        t = timed(lambda: xor_apply(work, frames[level], pool))
        _check_equal(work, b, f"XOR+zstd-{level}")
        if big:  # the base's words back, and its digest state (as restore() gives it)
            xor_undo(work, frames[level])
            work.invalidate()
            for n, st in sums.items():
                work.update_sum_state(n, st)
        return t

    methods: dict[str, Callable[[], float]] = {
        "rp enc": rp_enc,
        "xor1 enc": lambda: timed(lambda: xor_encode(a, b, pool, 1)),
        "xor3 enc": lambda: timed(lambda: xor_encode(a, b, pool, 3)),
        "rp": lambda: rp_dec(False),
        "rp inc": lambda: rp_dec(True),
        "xor1": lambda: xor_dec(1),
        "xor3": lambda: xor_dec(3),
    }
    if scratch is not None:  # below 1 GB (above it, transition() times memcpy on its own)
        sc = scratch
        methods["memcpy"] = lambda: timed(lambda: memcpy(a, sc, pool))
    return methods


def _numpy_reference(
    a: View, b: View, work: View, blob: bytes, inverse: bytes, reps: int
) -> tuple[float, float]:
    """The numpy codec's encode (its bytes must equal the native ones) and decode+apply."""
    core, native.core = native.core, None
    try:

        def nenc() -> bytes:
            b.invalidate()
            return encode(diff(a, b), a)

        t_nenc, nblob = best_of(nenc, reps)
        if nblob != blob:
            raise RoundTripError("numpy reference and native bytes differ")
        restore(work, a)
        t_ndec, _ = best_of(lambda: apply(work, decode(blob, work)), 1)
        _check_equal(work, b, "rollpatch numpy")
        if work is a:
            apply(work, decode(inverse, work))
        return t_nenc, t_ndec
    finally:
        native.core = core


def _encode_rss(enc: Callable[[], object]) -> int:
    """Peak RSS growth of ``enc()`` on a trimmed heap (its result dropped)."""
    trim_heap()
    reset_peak_rss()
    rss0 = current_rss()
    enc()
    return max(0, peak_rss() - rss0)


def first_encode_rss(threads: Sequence[int]) -> int:
    """Peak RSS growth of the process's first encodes of a small view (one per thread count):
    what a process sets up once and keeps (the header's level-9 zstd context per encoding
    thread, ~0.9 MB; the core's thread pool), measured here so that no row is charged with it."""
    rng = np.random.default_rng(0)
    n = 1 << 16
    a = View({"w": Tensor(KINDS["bf16"], (n,), rng.integers(0, 1 << 16, n, dtype=np.uint16))})
    b = a.copy()
    b["w"].data[::97] ^= 1

    def encodes() -> None:
        for t in threads:
            os.environ["ROLLPATCH_THREADS"] = str(t)
            b.invalidate()
            encode_views(a, b)

    return _encode_rss(encodes)
