"""How staged words reach a vLLM worker's parameters: the layout of a staged update per
runtime parameter (:func:`lay_out`: checkpoint positions to storage offsets, one parameter at
a time), the double-buffered exchange (:func:`exchange_buffers`), and the writes done after
the pause (:class:`Settler`). The :class:`Access`, :class:`ParamWrites` and the checked,
sliced, read-back writer (:func:`write_params`) are :mod:`rollpatch.engines.writing`'s,
re-exported here.

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
from dataclasses import replace
from typing import Any

import numpy as np

from ..staged import StagedUpdate, WriteMode
from ..writing import SLICE, Access, ParamWrites, increasing, release, write_params
from .layout import Placement, locate, locate_rows
from .memtrace import trim

__all__ = [
    "SLICE",
    "Access",
    "ParamWrites",
    "Settler",
    "WriteMode",
    "exchange_buffers",
    "increasing",
    "lay_out",
    "undo_writes",
    "write_params",
]


#: Bytes laid out between two trims of the freed memory (:func:`lay_out`). Each trim walks
#: every malloc arena and hands free pages back, which later allocations fault in again: at
#: 8 MiB a 5-step catch-up at 103M (88 MB laid out) trimmed ten times and its layout took
#: 85-89 ms; with none, 49-60 ms, and the staging peak before the packed kernels did not rise
#: (bench/vllm.py, 2026-12-04).
_TRIM_EVERY = 64 << 20


def _storage_order(pl: Placement) -> tuple[int, int, int]:
    return pl.slot, pl.dim, pl.dst_start


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
    freed = 0
    for param, names in by_param.items():
        # in storage order where the tensors are row blocks (q, k, v of qkv_proj; an expert's
        # slot): the offsets concatenate increasing, and ``increasing`` need not sort them
        names.sort(key=lambda n: _storage_order(placement(n)))
        chunks = []
        for name in names:
            st, pl = staged.tensors[name], placement(name)
            rows = locate_rows(pl, st.positions)
            if rows is not None:
                keep, offsets = rows
                if offsets.size:
                    chunks.append((offsets, st.old[keep], st.new[keep]))
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
        laid = staged.payload[param] = increasing(ParamWrites(prepare(param, offsets), old, new))
        freed += laid.prepared.nbytes + laid.old.nbytes + laid.new.nbytes
        if freed >= _TRIM_EVERY:  # the tensors' arrays freed lie in the decoder threads'
            trim()  # malloc arenas: give them back as we go, not after the peak
            freed = 0


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
            trim_ms = 0.0
            try:
                release(retired or {})
                write_params(acc, writes, parallel=False)  # generation runs meanwhile
            except Exception as err:  # noqa: BLE001 - reported through on_error
                error = f"{type(err).__name__}: {err}"
                on_error(next(iter(writes)), error)
            finally:
                trim_ms = trim()  # what the commit freed goes back to the system
                self.last = {
                    "params": len(writes),
                    "ms": (time.perf_counter() - t0) * 1e3,
                    "trim_ms": trim_ms,
                    "error": error,
                }
                self._done.set()

        self._thread = threading.Thread(target=run, daemon=True, name="rollpatch-settle")
        self._thread.start()


def undo_writes(acc: Access, writes: dict[str, ParamWrites]) -> None:
    """Put back the old words of committed in-place ``writes`` (the new words checked, the old
    ones written and read back: :func:`write_params` with the two swapped), then re-pack the
    touched modules' kernels from the words, whatever the writes did."""
    back = {p: ParamWrites(w.prepared, w.new, w.old) for p, w in writes.items()}
    try:
        write_params(acc, back, parallel=True)
    finally:
        acc.repack(set(writes))
