"""How staged words reach a worker's parameters: the :class:`Access` the engine glue lends,
the per-parameter writes a staged update carries (:func:`lay_out`: checkpoint positions to
storage offsets, one parameter at a time), and the writers that put them in place.

A commit writes each runtime parameter in slices of :data:`SLICE` positions: the old words
checked as they are overwritten (where the access can), each slice read back while it is still
in cache; parameters in parallel on the CPU. On any failure the words already written are put
back, so a failed commit leaves the old version whole.

Parameters the engine reads only through a packed kernel that holds its own copy of the words
(``Access.kernel_only``; vLLM's CPU linear layers) are served from the kernel rebuilt before
the pause and swapped in under it; their own words are then written after the pause by a
:class:`Settler` thread, with the same checks. Readers of the words wait for it
(:meth:`Settler.wait`), and a write that fails there marks the engine tainted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ...errors import TargetMismatchError
from ...native import threads
from ..staged import StagedUpdate, WriteMode
from .layout import Placement, locate, locate_whole

__all__ = [
    "SLICE",
    "Access",
    "ParamWrites",
    "Settler",
    "WriteMode",
    "exchange_buffers",
    "increasing",
    "lay_out",
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
    #: (increasing storage offsets) are ``old`` and writes ``new``, in one pass, all or
    #: nothing (raises :class:`BaseMismatchError`); else the commit scatters blindly.
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


def lay_out(
    staged: StagedUpdate,
    placement: Callable[[str], Placement],
    prepare: Callable[[str, np.ndarray], np.ndarray],
) -> None:
    """``staged``'s writes per runtime parameter (storage offsets, old and new words, in
    storage order) into its payload, one parameter at a time; each tensor's arrays are released
    as soon as its parameter is laid out (only the proven states stay per tensor), so the peak
    is about one staged update plus one parameter's share."""
    by_param: dict[str, list[str]] = {}
    for name in staged.tensors:
        by_param.setdefault(placement(name).param, []).append(name)
    staged.payload["changed"] = staged.changed
    empty = np.empty(0, np.int64)
    for param, names in by_param.items():
        chunks = []
        for name in names:
            st, pl = staged.tensors[name], placement(name)
            offsets = locate_whole(pl, st.positions)
            if offsets is not None:
                chunks.append((offsets, st.old, st.new))
            else:
                held, offsets = locate(pl, st.positions)
                if offsets.size:
                    chunks.append((offsets, st.old[held], st.new[held]))
            staged.tensors[name] = replace(st, positions=empty, old=st.old[:0], new=st.new[:0])
        if not chunks:
            continue
        if len(chunks) == 1:
            offsets, old, new = chunks[0]
        else:
            offsets, old, new = (np.concatenate([c[i] for c in chunks]) for i in range(3))
        del chunks
        staged.payload[param] = increasing(ParamWrites(prepare(param, offsets), old, new))


def write_params(acc: Access, writes: dict[str, ParamWrites], *, parallel: bool) -> int:
    """Write every parameter of ``writes`` (checked, sliced, read back); returns the number
    of threads used. On failure the parameters started are restored and the error raised."""
    scatter = acc.scatter or (lambda param, off, values: acc.write(param, off, values))
    read_at = acc.read_at or (lambda param, off: acc.read(param).reshape(-1)[off])
    write = acc.swap or (lambda param, off, old, new: scatter(param, off, new))
    started: list[str] = []

    def one(param: str) -> None:
        w = writes[param]
        started.append(param)
        for i in range(0, w.prepared.size, SLICE):
            s = slice(i, i + SLICE)
            write(param, w.prepared[s], w.old[s], w.new[s])
            if not np.array_equal(read_at(param, w.prepared[s]), w.new[s]):
                raise TargetMismatchError("read-back of written weights differs", param=param)

    n = min(threads(), len(writes)) if parallel and acc.aliases else 1
    try:
        if n > 1:  # the writes are the only work that matters now: on every core
            with ThreadPoolExecutor(n, thread_name_prefix="rollpatch-write") as pool:
                list(pool.map(one, writes))
        else:
            for param in writes:
                one(param)
    except BaseException:
        for param in started:  # words not reached yet are the old ones already
            scatter(param, writes[param].prepared, writes[param].old)
        raise
    return max(n, 1)


def exchange_buffers(
    acc: Access, buffers: dict[str, Any], prebuilt: dict[str, Any] | None, params: set[str]
) -> tuple[dict[str, float], dict[str, Any]]:
    """The double-buffered commit under the pause: the staged buffers (written, checked and
    read back while staging) put in place of the parameters' storage, the kernels built from
    them swapped in; undone on any failure. Returns the pause's phases (ms) and the storage
    replaced, to be released after the pause (freeing a model's worth of memory takes time)."""
    assert acc.exchange is not None
    t0 = time.perf_counter()
    held = acc.exchange(buffers)
    try:
        installed = acc.install(prebuilt) if prebuilt and acc.install is not None else set()
        acc.repack({p for p in params if p.rpartition(".")[0] not in installed})
    except BaseException:
        acc.exchange(held)
        acc.repack(params)
        raise
    ms = (time.perf_counter() - t0) * 1e3
    return {"write_ms": 0.0, "exchange_ms": ms, "threads": 1.0, "written_after": 0.0}, held


class Settler:
    """Writes of kernel-only parameters done after the pause, one batch at a time."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()
        self._thread: threading.Thread | None = None
        #: The last batch: its size, the time it took (ms) and its failure, if any.
        self.last: dict[str, Any] = {}

    @property
    def busy(self) -> bool:
        """True while a batch is being written."""
        return not self._done.is_set()

    def wait(self) -> None:
        """Block until the words match the served kernels (no-op when nothing is pending)."""
        if not self._done.is_set() and threading.current_thread() is not self._thread:
            self._done.wait()

    def start(
        self,
        acc: Access,
        writes: dict[str, ParamWrites],
        on_error: Callable[[str, str], None],
        retired: dict[str, Any] | None = None,
    ) -> None:
        """Write ``writes`` in a background thread (after :meth:`wait`); ``on_error(param,
        message)`` is called if a check fails (the words are then restored). ``retired``:
        storage the pause replaced, released there one tensor at a time."""
        self.wait()
        if not writes and not retired:
            return
        self._done.clear()

        def run() -> None:
            t0 = time.perf_counter()
            error = None
            try:
                while retired:
                    retired.popitem()  # one tensor's memory back at a time
                    time.sleep(0)
                write_params(acc, writes, parallel=False)  # generation runs meanwhile
            except Exception as err:  # noqa: BLE001 - reported through on_error
                error = f"{type(err).__name__}: {err}"
                on_error(next(iter(writes)), error)
            finally:
                self.last = {
                    "params": len(writes),
                    "ms": (time.perf_counter() - t0) * 1e3,
                    "error": error,
                }
                self._done.set()

        self._thread = threading.Thread(target=run, daemon=True, name="rollpatch-settle")
        self._thread.start()
