"""The baselines bench/codec.py measures rollpatch against, per tensor on a thread pool.

XOR+zstd (the Stitch encoder's method, modal-projects/miles ``disk_delta.py``: numpy XOR of
old and new words, zstd, xxh3-128 of the new tensor) and memcpy (the physical yardstick).
The baseline is written as a competent user would run it in a loop: per thread one scratch
buffer of the largest tensor's size and one zstd context per level, reused; XOR and
decompression go into the scratch, so neither side of the comparison pays fresh pages or
context setup per tensor (rollpatch keeps its own work arrays: rollpatch.patch.spare).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash
import zstandard

from rollpatch.view import View


class RoundTripError(SystemExit):
    """A decode+apply did not reproduce the target bit for bit."""


_tls = threading.local()


def _state(
    size: int,
) -> tuple[np.ndarray, dict[int, zstandard.ZstdCompressor], zstandard.ZstdDecompressor]:
    """This thread's scratch buffer (at least ``size`` bytes, its pages faulted in once) and its
    zstd contexts, kept for every tensor and every call, as a competent user keeps them: no
    tensor-sized allocation (fresh pages) and no context creation per tensor."""
    st = getattr(_tls, "st", None)
    if st is None or st[0].nbytes < size:
        st = _tls.st = (np.ones(size, np.uint8), {}, zstandard.ZstdDecompressor())
    return st


def _largest(view: View) -> int:
    return max((view[n].nbytes for n in view), default=0)


def xor_encode(
    a: View, b: View, pool: ThreadPoolExecutor, level: int
) -> dict[str, tuple[bytes, bytes]]:
    """Per tensor: (zstd frame of old XOR new words, xxh3-128 of the new words); the XOR goes
    into the thread's scratch buffer, compressed by the thread's reused compressor."""
    size = _largest(b)

    def one(name: str) -> tuple[bytes, bytes]:
        buf, cctxs, _ = _state(size)
        cctx = cctxs.get(level) or cctxs.setdefault(level, zstandard.ZstdCompressor(level=level))
        new = b[name].data
        x = buf[: new.nbytes]
        np.bitwise_xor(a[name].data, new, out=x.view(new.dtype).reshape(new.shape))
        return cctx.compress(memoryview(x)), xxhash.xxh3_128_digest(new)

    names = sorted(b)
    return dict(zip(names, pool.map(one, names)))


def xor_apply(view: View, frames: dict[str, tuple[bytes, bytes]], pool: ThreadPoolExecutor) -> None:
    """Decompress into the thread's scratch buffer (reused decompressor), XOR into ``view`` in
    place, then check each xxh3-128."""
    size = _largest(view)

    def one(name: str) -> None:
        buf, _, dctx = _state(size)
        frame, digest = frames[name]
        data = view[name].data
        x = buf[: data.nbytes]
        with dctx.stream_reader(frame, read_across_frames=False, closefd=False) as r:
            got = r.readinto(memoryview(x))
        if got != data.nbytes:
            raise RoundTripError(f"XOR+zstd frame of {name}: {got} bytes, not {data.nbytes}")
        np.bitwise_xor(data, x.view(data.dtype).reshape(data.shape), out=data)
        if xxhash.xxh3_128_digest(data) != digest:
            raise RoundTripError(f"XOR+zstd checksum mismatch on {name}")

    for _ in pool.map(one, sorted(frames)):
        pass


def memcpy(src: View, dst: dict[str, np.ndarray], pool: ThreadPoolExecutor) -> None:
    def one(name: str) -> None:
        np.copyto(dst[name], src[name].data)

    for _ in pool.map(one, sorted(src)):
        pass


def copy_buffers(src: View, threads: int) -> list[np.ndarray]:
    """One buffer per thread of ``src``'s largest tensor's size, its pages faulted in (for
    :func:`memcpy_reused`)."""
    size = max((src[n].nbytes for n in src), default=0)
    return [np.ones(size, np.uint8) for _ in range(max(1, threads))]


def memcpy_reused(src: View, bufs: list[np.ndarray], pool: ThreadPoolExecutor) -> None:
    """Copy every tensor of ``src``, largest first, on one thread per buffer of ``bufs``
    (from :func:`copy_buffers`), each into its thread's buffer, reused for every tensor:
    no third view, for views too large to hold beside the simulator."""
    names = sorted(src, key=lambda n: -src[n].nbytes)

    def part(i: int) -> None:
        buf = bufs[i]
        for n in names[i :: len(bufs)]:
            d = src[n].data
            np.copyto(buf[: d.nbytes].view(d.dtype).reshape(d.shape), d)

    for _ in pool.map(part, range(len(bufs))):
        pass


def xor_undo(view: View, frames: dict[str, tuple[bytes, bytes]]) -> None:
    """XOR is its own inverse: put the base back after an in-place XOR apply."""
    for name, (frame, _) in frames.items():
        data = view[name].data
        np.bitwise_xor(
            data,
            np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=data.dtype),
            out=data,
        )


def restore(work: View, base: View) -> View:
    """Put ``base``'s words back into the receiver's ``work`` between timed applies, with
    ``base``'s digest state (the receiver holds the digests of its current version);
    ``work is base`` (in-place mode: every measurement puts the base back itself) is left
    alone."""
    if work is base:
        return work
    for n in base:
        np.copyto(work[n].data, base[n].data)
    work.invalidate()
    for n in base:
        work.update_sum_state(n, base.sum_state(n))
    return work
