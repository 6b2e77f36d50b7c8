"""bench/codec.py's measurement of one transition a → b (encode, decode+apply, the XOR+zstd
baselines and memcpy at every thread count, the encode's memory, the i.i.d. bound), and the
process's one-time encode state; bench/codec.py drives the simulator and prints the table."""

from __future__ import annotations

import math
import os
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
            if scratch is None:  # one buffer of the largest tensor's size per thread, reused
                bufs = copy_buffers(a, threads)
                t_mc, _ = best_of(lambda: memcpy_reused(a, bufs, pool), reps)  # noqa: B023
                del bufs
            else:
                t_mc, _ = best_of(lambda: memcpy(a, scratch, pool), reps)

            def enc() -> bytes:
                b.invalidate()
                return encode_views(a, b)

            # memory: the row's first encode (with what this process sets up for the row once:
            # the header's zstd context grown to its size, the C heap's first use of this
            # thread count), then one after the timed encodes (what a publisher pays per
            # version); each with no earlier result alive (best_of keeps the last one), on a
            # trimmed heap (every page it touches counts, whatever ran before)
            blob = b""
            first = _encode_rss(enc)
            t_enc, blob = best_of(enc, reps)
            blob = b""
            extra = _encode_rss(enc)
            blob = enc()
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
        row.enc_first = max(row.enc_first, first)
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
                "enc_first_bytes": first,
            }
        )
    n, k, whole = bound_bits(a, b)
    for row in rows.values():
        row.elements += n
        row.changed += k
        row.bound_bits += whole


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
