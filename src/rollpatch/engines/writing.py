"""Staged words written into an engine's parameters: the :class:`Access` an engine's glue
lends, one parameter's staged writes (:class:`ParamWrites`), and :func:`write_params`, the
checked, sliced, read-back writer both the vLLM worker and the SGLang extension commit with.

A commit writes each parameter in slices of :data:`SLICE` positions: the old words checked as
they are overwritten (the native core's ``apply``, where the access has it), each slice read
back while it is still in cache; parameters in parallel on the CPU. On any failure the words
already written are put back, so a failed commit leaves the old version whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import EngineError, TargetMismatchError
from ..native import threads

__all__ = [
    "SLICE",
    "Access",
    "ParamWrites",
    "check_and_write",
    "check_write",
    "copy_with_writes",
    "increasing",
    "numpy_access",
    "release",
    "release_later",
    "warm_writers",
    "write_params",
]

#: Positions written then read back at a time (a slice's words stay in cache).
SLICE = 1 << 16


@dataclass
class Access:
    """How the core reaches one worker's parameters (implemented by the engine glue).

    ``read(param)``: the parameter's words as a numpy array of its logical 2-D shape — a view
    of the parameter's memory where possible (CPU), else a host copy (GPU).
    ``write(param, offsets, values)``: store words at row-major logical ``offsets``
    (stride-aware). ``write_block(param, index, block)``: store a 2-D block at a pair of
    slices (keyframe loads: no per-element offsets). ``repack(params)``: rebuild derived buffers
    after writing those parameters. ``gather(param, local)``: every rank's copy of ``param``
    (TP > 1), in rank order. ``aliases``: True when ``read`` returns views, so lent tensors can
    be zero-copy.
    """

    read: Callable[[str], np.ndarray]
    write: Callable[[str, np.ndarray, np.ndarray], None]
    write_block: Callable[[str, tuple[slice, slice], np.ndarray], None]
    repack: Callable[[set[str]], None] = lambda params: None
    gather: Callable[[str, np.ndarray], list[np.ndarray]] | None = None
    aliases: bool = False
    prepare: Callable[[str, np.ndarray], np.ndarray] | None = None
    scatter: Callable[[str, np.ndarray, np.ndarray], None] | None = None
    read_at: Callable[[str, np.ndarray], np.ndarray] | None = None
    #: Optional (CPU): derived buffers built before the pause from the staged words
    #: (``prebuild({param: (prepared, old, new)}, buffers)``: old words checked, new ones read
    #: back in a copy, or built from the double-buffered commit's ``buffers``), swapped in under it (``install(prebuilt)`` → the modules installed), so
    #: the pause does not re-pack whole modules.
    prebuild: Callable[..., Any] | None = None
    install: Callable[[Any], set[str]] | None = None
    #: Optional: ``swap(param, prepared, old, new)`` checks that the words at ``prepared``
    #: (increasing storage offsets) are ``old``, writes ``new`` and reads it back, in one
    #: pass, all or nothing (raises :class:`BaseMismatchError` / :class:`TargetMismatchError`:
    #: :func:`check_and_write` with ``readback``); else the commit scatters blindly and
    #: :func:`write_params` reads back.
    swap: Callable[[str, np.ndarray, np.ndarray, np.ndarray], None] | None = None
    #: Optional (CPU): ``kernel_only(param)`` is True when the engine reads ``param`` only
    #: through its module's packed kernel, which holds its own copy of the words. Once a
    #: prebuilt kernel is installed, such a parameter's own words are written after the
    #: pause, in the background (:class:`Settler`).
    kernel_only: Callable[[str], bool] | None = None
    #: Optional (CPU): the double-buffered commit. ``buffer(param, prepared, old, new)``
    #: → a second buffer of ``param`` with the writes in (checked, read back), before the
    #: pause; ``exchange({param: buffer})`` puts the buffers in place of the parameters'
    #: storage under the pause (O(1) each) and returns the buffers it replaced.
    buffer: Callable[[str, np.ndarray, np.ndarray, np.ndarray], Any] | None = None
    exchange: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    #: Optional (TP > 1): ``own_collectives()``, a context in which the calling thread's
    #: ``gather`` calls go through a group of their own, so staging can run in a thread
    #: beside the engine loop's collectives; None: staging at TP > 1 runs on the engine loop.
    own_collectives: Callable[[], AbstractContextManager[None]] | None = None
    #: Optional (TP > 1): a tensor decoded by one rank and its result shared
    #: (:mod:`rollpatch.engines.vllm.tpdecode`). ``gather_to(param, local, dst)``: every
    #: rank's ``local`` in rank order on rank ``dst``, None on the others, started at the
    #: call and finished by calling what it returns (transfers finish in the order started);
    #: ``share(data, src, size)``: rank ``src``'s bytes on every rank (the others pass
    #: None) as ``size`` bytes, a size every rank knows. Collectives, as ``gather``, through
    #: the same group.
    gather_to: Callable[[str, np.ndarray, int], Callable[[], list[np.ndarray] | None]] | None = None
    share: Callable[[bytes | None, int, int], memoryview] | None = None
    #: Optional (TP > 1): ``deliver(parts, sizes)``, point to point between every pair of
    #: ranks: ``parts[q]`` to rank ``q``, and from each rank ``q`` the ``sizes[q]`` bytes it
    #: sends this one; returns them in rank order (this rank's own entry empty). A
    #: collective, as ``share``; ``delivers()`` says whether it can run for the calling
    #: thread. A tensor's decoded change then goes to each rank for its block only.
    deliver: Callable[[list[bytes], list[int]], list[memoryview]] | None = None
    delivers: Callable[[], bool] | None = None


@dataclass
class ParamWrites:
    """One runtime parameter's staged writes (every checkpoint tensor fused into it)."""

    prepared: np.ndarray
    old: np.ndarray
    new: np.ndarray


def increasing(w: ParamWrites) -> ParamWrites:
    """The writes in storage order (done while staging: the pause then writes and reads
    memory front to back, and a one-pass check-and-write can rely on it)."""
    if w.prepared.size > 1 and not bool(np.all(w.prepared[1:] > w.prepared[:-1])):
        order = np.argsort(w.prepared, kind="stable")
        w = ParamWrites(w.prepared[order], w.old[order], w.new[order])
    return w


def write_params(acc: Access, writes: dict[str, ParamWrites], *, parallel: bool) -> int:
    """Write every parameter of ``writes`` (checked, sliced, read back); returns the number
    of threads used. On failure the parameters started are restored and the error raised."""
    scatter = acc.scatter or (lambda param, off, values: acc.write(param, off, values))
    read_at = acc.read_at or (lambda param, off: acc.read(param).reshape(-1)[off])
    write = acc.swap or (lambda param, off, old, new: scatter(param, off, new))
    reads_back = acc.swap is not None  # a swap reads its own writes back
    started: list[str] = []

    def one(param: str) -> None:
        w = writes[param]
        started.append(param)
        for i in range(0, w.prepared.size, SLICE):
            s = slice(i, i + SLICE)
            write(param, w.prepared[s], w.old[s], w.new[s])
            if not reads_back and not np.array_equal(read_at(param, w.prepared[s]), w.new[s]):
                raise TargetMismatchError("read-back of written weights differs", param=param)

    n = min(threads(), len(writes)) if parallel and acc.aliases else 1
    try:
        if n > 1:  # the writes are the only work that matters now: on every core
            futures = [_pool(n).submit(one, param) for param in writes]
            wait(futures)  # every task ends before a failure restores the words
            for f in futures:
                f.result()
        else:
            for param in writes:
                one(param)
    except BaseException:
        for param in started:  # words not reached yet are the old ones already
            scatter(param, writes[param].prepared, writes[param].old)
        raise
    return max(n, 1)


def check_and_write(
    flat: np.ndarray,
    off: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    name: str,
    *,
    readback: bool = False,
) -> None:
    """Check that the words of ``flat`` at ``off`` (increasing) are ``old`` and write ``new``;
    all or nothing (a mismatch puts back what was written before it is raised).
    ``readback``: the written words are also read back and compared (natively as it goes,
    every 256 changes while their lines are in L1; :class:`TargetMismatchError`, with the
    old words put back, on a difference).

    With the native core: its ``apply``, one pass (each word read once, compared, written;
    the lines prefetched ahead), no GIL: 3.9 ms for 845k changes in a 130 MB BF16 tensor,
    against 5 ms for a native gather, a compare and numpy's scatter (what this did while the
    core's apply ran out of cache misses in flight: 22 ms). It also sums the rp.sum128
    change of the words, which the staged commit has proven already and does not use.
    Without it, or for positions out of order: gather, compare, then numpy's scatter."""
    from .. import native
    from ..errors import BaseMismatchError, PatchDecodeError

    core = native.core
    w = flat.itemsize
    if (
        core is not None
        and w in (1, 2, 4, 8)
        and flat.flags.c_contiguous
        and old.dtype.itemsize == new.dtype.itemsize == w  # words as they are, never cast
    ):
        arrays = (np.ascontiguousarray(off, np.int64), np.ascontiguousarray(old))
        try:
            core.apply((8 * w, 2, 0, 0), flat, *arrays, np.ascontiguousarray(new), False, readback)
            return
        except PatchDecodeError as err:  # the core's read-back (every write put back)
            raise TargetMismatchError("read-back of written weights differs", param=name) from err
        except BaseMismatchError as err:  # nothing written
            raise BaseMismatchError(
                "held words differ from the update's old words", param=name
            ) from err
        except ValueError:  # positions not increasing (nothing written): the general path
            pass  # (a read-only buffer is a TypeError: raised as it is)
    if w in (1, 2, 4, 8) and old.dtype.itemsize == new.dtype.itemsize == w:
        # compared and written as words: as floats, NaN != NaN and -0 == +0, and numpy
        # would cast words of another type by value
        flat, old, new = (a.view(f"u{w}") for a in (flat, old, new))
    if core is not None and w in (2, 4) and flat.flags.c_contiguous:
        held = np.empty(off.size, flat.dtype)
        core.gather((8 * w, 2, 0, 0), flat, off, held)  # GIL released
    else:
        held = flat[off]
    if not np.array_equal(held, old):
        raise BaseMismatchError("held words differ from the update's old words", param=name)
    _scatter(flat, off, new)
    if readback and not np.array_equal(flat[off], new):
        flat[off] = old
        raise TargetMismatchError("read-back of written weights differs", param=name)


def _scatter(flat: np.ndarray, off: np.ndarray, new: np.ndarray) -> None:
    """The general path's write (its own function: a test stubs it to make a write miss)."""
    flat[off] = new


def check_write(
    flat: np.ndarray, off: np.ndarray, old: np.ndarray, new: np.ndarray, name: str
) -> None:
    """:func:`check_and_write` with the written words read back (compared as words)."""
    check_and_write(flat, off, old, new, name, readback=True)


def copy_with_writes(
    src: np.ndarray, dst: np.ndarray, off: np.ndarray, old: np.ndarray, new: np.ndarray, name: str
) -> None:
    """Fill ``dst`` (flat, the shape and dtype of ``src``) with ``src``'s words, ``new``
    written at ``off`` (increasing) where ``src`` holds ``old``, and read back: a second
    buffer, or the copy a prebuilt kernel is packed from. With the native core one pass, block
    by block in L1 (``copy_apply``: a 44 MiB BF16 tensor at 2.7% changed took 8-12 ms
    against 18 for a copy, a checked scatter and a read-back; 10-14 against 27 at 7%); else
    those three steps. Raises :class:`BaseMismatchError` (an old word differs) or
    :class:`TargetMismatchError` (a read-back differs); ``dst`` is then scratch."""
    from .. import native
    from ..errors import BaseMismatchError, PatchDecodeError

    core, w = native.core, src.itemsize
    if src.shape != dst.shape or src.dtype != dst.dtype or src.ndim != 1:
        raise ValueError("copy_with_writes: src and dst must be flat arrays of one layout")
    if np.may_share_memory(src, dst):
        raise ValueError("copy_with_writes: src and dst overlap")
    if (
        core is not None
        and w in (1, 2, 4, 8)
        and src.flags.c_contiguous
        and dst.flags.c_contiguous
        and old.dtype.itemsize == new.dtype.itemsize == w  # words as they are, never cast
    ):
        arrays = (np.ascontiguousarray(off, np.int64), np.ascontiguousarray(old))
        try:
            core.copy_apply(w, src, dst, *arrays, np.ascontiguousarray(new))
            return
        except ValueError:  # positions out of range or order: the general path says which
            pass
        except BaseMismatchError as err:
            raise BaseMismatchError(
                "held words differ from the update's old words", param=name, detail=str(err)
            ) from err
        except PatchDecodeError as err:  # the core's read-back
            raise TargetMismatchError("read-back of written weights differs", param=name) from err
    np.copyto(dst, src)
    check_write(dst, off, old, new, name)


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    """A pool of ``n`` writer threads kept for the process (starting threads inside a pause
    cost 0.1-1 ms each, more on a loaded machine)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="rollpatch-write")
        return pool


def warm_writers() -> None:
    """Start the writer threads now (call while staging), so no pause starts one."""
    n = threads()
    if n > 1:
        list(_pool(n).map(lambda _: None, range(n)))


def release_later(retired: dict[str, Any]) -> None:
    """:func:`release` on one background thread kept for the process (not a thread started
    inside the pause)."""
    _pool(1).submit(release, retired)


def release(retired: dict[str, Any]) -> None:
    """Drop ``retired`` (storage an exchange replaced) one entry at a time, letting other
    threads run between frees (freeing a model's worth of memory takes a while)."""
    import time

    while retired:
        retired.popitem()
        time.sleep(0)


def numpy_access(params: Mapping[str, np.ndarray]) -> Access:
    """An :class:`Access` over C-contiguous numpy arrays that are the parameters' own memory
    (offsets are flat row-major; the native core checks and writes where it can)."""
    from .. import native

    core = native.core

    def flat(p: str) -> np.ndarray:
        a = params[p]
        if not a.flags.c_contiguous:  # reshape would copy: writes and read-backs would miss
            raise EngineError("a parameter's words are not contiguous", param=p)
        return a.reshape(-1)

    def scatter(p: str, off: np.ndarray, values: np.ndarray) -> None:
        flat(p)[off] = values

    def read_at(p: str, off: np.ndarray) -> np.ndarray:
        fl = flat(p)
        if core is None or fl.itemsize not in (2, 4):
            return fl[off]
        out = np.empty(off.size, fl.dtype)
        core.gather((8 * fl.itemsize, 2, 0, 0), fl, off, out)  # GIL released
        return out

    def swap(p: str, off: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        check_and_write(flat(p), off, old, new, p, readback=True)

    def write_block(p: str, index: tuple[slice, slice], block: np.ndarray) -> None:
        params[p][index] = block

    return Access(
        lambda p: params[p],
        scatter,
        write_block,
        aliases=True,
        scatter=scatter,
        read_at=read_at,
        swap=swap,
    )
