"""``rp.ctxgolomb.v2``: the default delta codec, native when built, numpy otherwise.

Both paths write the same bytes (docs/patch-format.md §4b). Large tensors are coded and
decoded in chunk ranges on a thread pool; the native core releases the GIL.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from .. import native
from ..errors import PatchDecodeError
from ..kinds import Kind, single_context
from ..native import parallel_map, threads
from ..view import Tensor, sum_add
from .bits import write_varint
from .ctxv2 import CHUNK, decode_ref, encode_ref

__all__ = ["ChunkRecords", "CtxGolombV2"]


@dataclass(frozen=True)
class ChunkRecords:
    """One chunk's changes as the coder needs them (docs/patch-format.md §4b).

    ``sizes``: 256 counts, elements of the chunk per context (context = ``(old >> ctx_shift)
    & (2^ctx_bits - 1)``, or 0 for single-context tensors: see ``native.kind_tuple``);
    ``positions``: changed elements relative to the chunk start, increasing; ``contexts``,
    ``ranks`` (index of the element among the chunk's elements of its context), ``old`` and
    ``new`` (element values) per change.
    """

    sizes: np.ndarray
    positions: np.ndarray
    contexts: np.ndarray
    ranks: np.ndarray
    old: np.ndarray
    new: np.ndarray


def _single(base: Tensor) -> bool:
    return single_context(base.kind, base.n_elements)


def _ranges(nchunks: int, parts: int) -> list[tuple[int, int]]:
    step = -(-nchunks // max(1, parts))
    step = max(4, -(-step // 4) * 4)  # whole groups of four: one native call decodes up to four
    return [(a, min(a + step, nchunks)) for a in range(0, nchunks, step)]


#: Target jobs per thread of a many-job native call: the jobs are taken as threads come free,
#: so several per thread keep a thread that another process delays from holding up the rest.
JOBS_PER_THREAD = 4


def job_step(nchunks: int, threads: int) -> int:
    """Chunks per job of one tensor in a many-job native call: the whole tensor on one thread;
    on several, ranges of at least 2 chunks, about ``JOBS_PER_THREAD`` per thread for the
    largest tensors (a range's fixed cost is a few microseconds; a chunk is ~0.5 ms). The
    decoder's native call cuts the ranges itself from this step."""
    if threads <= 1 or nchunks <= 2:
        return max(1, nchunks)
    return max(2, -(-nchunks // (JOBS_PER_THREAD * threads)))


def job_ranges(nchunks: int, threads: int) -> list[tuple[int, int]]:
    """One tensor's ranges of chunks (:func:`job_step` each), in order."""
    step = job_step(nchunks, threads)
    return [(a, min(a + step, nchunks)) for a in range(0, nchunks, step)]


@dataclass(frozen=True)
class CtxGolombV2:
    """Chunked context-modelled Golomb codes (v1's model, one pass to decode)."""

    codec_id: str = "rp.ctxgolomb.v2"
    reference: bool = False  # force the numpy reference (tests compare the two)

    def _native(self) -> bool:
        return native.core is not None and not self.reference

    def encode(
        self, base: Tensor, positions: np.ndarray, old: np.ndarray, new: np.ndarray
    ) -> bytes:
        if not self._native():
            return encode_ref(base.kind, base.elements(), _single(base), positions, old, new)
        core = native.require()
        kt = native.kind_tuple(base.kind, base.n_elements)
        n = base.n_elements
        bounds = np.searchsorted(positions, np.arange(0, n + CHUNK, CHUNK)).tolist()
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        o64 = np.ascontiguousarray(old, dtype=np.uint64)
        n64 = np.ascontiguousarray(new, dtype=np.uint64)

        def one(i: int) -> bytes:
            lo, hi = bounds[i], bounds[i + 1]
            if lo == hi:
                return b""
            s = i * CHUNK
            return core.encode_sparse(
                kt, base.data, s, min(CHUNK, n - s), pos[lo:hi] - s, o64[lo:hi], n64[lo:hi]
            )

        bodies = parallel_map(one, list(range(-(-n // CHUNK))))
        return _join(bodies)

    def encode_dense(self, base: Tensor, target: Tensor) -> tuple[bytes, int]:
        """Payload and changed count straight from two tensors (one fused native pass)."""
        payload, k, _ = self.encode_dense_sum(base, target)
        return bytes(payload), k

    def encode_dense_sum(
        self, base: Tensor, target: Tensor
    ) -> tuple[memoryview, int, tuple[int, int]]:
        """:meth:`encode_dense`, plus the rp.sum128 change of ``target``'s words over
        ``base``'s (summed over the words that hold changes: the pass compared every word, so
        ``sum128(target) = sum128(base) + change`` exactly).

        The payload is a read-only view of a buffer the core wrote the chunks into (each
        range of chunks once, no per-chunk objects); dropping the last reference gives a large
        payload's pages back at once, which is what keeps the patch's assembly from holding
        the payloads and the patch both (:func:`rollpatch.patch.wire.assemble`).
        """
        return self.encode_dense_many([(base, target)])[0]

    def encode_dense_many(
        self, pairs: list[tuple[Tensor, Tensor]]
    ) -> list[tuple[memoryview, int, tuple[int, int]]]:
        """:meth:`encode_dense_sum` of each (base, target) pair, in one native call: every
        (tensor, range of chunks) is one job, largest first, on the core's own T threads
        (``core.encode_jobs``: the GIL released once for the whole view, no Python per job;
        a Python pool of T threads cost a core's worth of dispatch on 2 cores).

        ``core.encode_view`` cuts those jobs (:func:`job_ranges`), sorts them and joins each
        tensor's ranges in C: the same results without the per-tensor and per-job Python
        (0.58 -> 0.14 ms of serial Python at nvfp4 100M, 279 tensors)."""
        core = native.require()
        got = core.encode_view(
            [(native.kind_tuple(t.kind, t.n_elements), t.data, u.data) for t, u in pairs],
            threads(),
            JOBS_PER_THREAD,
        )
        return [(memoryview(buf), k, (d0, d1)) for buf, k, d0, d1 in got]

    def encode_dense_arena(
        self, pairs: list[tuple[Tensor, Tensor]]
    ) -> tuple[Any, list[tuple[memoryview, int, tuple[int, int]]]]:
        """:meth:`encode_dense_many`, every payload a view into one native buffer (the
        arena, returned first) that holds them in pair order and nothing else
        (``core.encode_view_arena``: the jobs run in that order, results committed as the jobs
        before them finish). Pairs in the container's order: the arena is the container's
        payload section, copied out whole (:func:`rollpatch.patch.wire.assemble`). A core
        without it: (None, :meth:`encode_dense_many`)."""
        core = native.require()
        fn = getattr(core, "encode_view_arena", None)
        if fn is None:
            return None, self.encode_dense_many(pairs)
        arena, got = fn(
            [(native.kind_tuple(t.kind, t.n_elements), t.data, u.data) for t, u in pairs],
            threads(),
            JOBS_PER_THREAD,
        )
        mv = memoryview(arena)
        return arena, [(mv[o : o + n], k, (d0, d1)) for o, n, k, d0, d1 in got]

    def encode_dense_changes(
        self, base: Tensor, target: Tensor
    ) -> tuple[bytes, tuple[int, int], np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`encode_dense_sum`, plus the changes the pass found: positions (int64,
        increasing) and the old and new elements (``kind.elem_dtype``), exactly what
        ``diff`` gathers, with no second compare."""
        flat, change = self._dense_pass(base, target, keep=True)
        dt = base.kind.elem_dtype

        def cat(i: int, dtype: Any) -> np.ndarray:
            arrays = [np.frombuffer(x[i], dtype=dtype) for x in flat if x[1]]
            return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)

        positions = cat(2, np.int64)
        old, new = cat(3, np.uint64).astype(dt), cat(4, np.uint64).astype(dt)
        return _join([x[0] for x in flat]), change, positions, old, new

    def _dense_pass(
        self, base: Tensor, target: Tensor, *, keep: bool
    ) -> tuple[list[tuple[Any, ...]], tuple[int, int]]:
        """Every chunk's native result in order (threads over ranges of chunks), and the
        summed rp.sum128 change."""
        core = native.require()
        kt = native.kind_tuple(base.kind, base.n_elements)
        nch = -(-base.n_elements // CHUNK)
        fn = core.encode_range_keep if keep else core.encode_range
        parts = parallel_map(
            lambda r: fn(kt, base.data, target.data, r[0], r[1]), _ranges(nch, threads())
        )
        change = (0, 0)
        for _, d0, d1 in parts:
            change = sum_add(change, (d0, d1))
        return [x for part, _, _ in parts for x in part], change

    def encode_records(
        self, base_kind: Kind, n_elements: int, chunks: list[ChunkRecords | None]
    ) -> bytes:
        """Payload from per-chunk records computed elsewhere (the trainer's device).

        ``chunks[i]`` covers elements ``[i*CHUNK, min((i+1)*CHUNK, n))``, or is None when
        nothing changed there. The native core validates every record.
        """
        core = native.require()
        kt = native.kind_tuple(base_kind, n_elements)
        if len(chunks) != -(-n_elements // CHUNK):
            raise ValueError("one record set (or None) per chunk")

        def one(i: int) -> bytes:
            r = chunks[i]
            if r is None or r.positions.size == 0:
                return b""
            n = min(CHUNK, n_elements - i * CHUNK)
            return core.encode_records(
                kt,
                n,
                np.ascontiguousarray(r.sizes, dtype=np.uint64),
                np.ascontiguousarray(r.positions, dtype=np.int64),
                np.ascontiguousarray(r.contexts, dtype=np.uint8),
                np.ascontiguousarray(r.ranks, dtype=np.uint32),
                np.ascontiguousarray(r.old, dtype=np.uint64),
                np.ascontiguousarray(r.new, dtype=np.uint64),
            )

        return _join(parallel_map(one, list(range(len(chunks)))))

    def _outputs(
        self,
        payload: memoryview,
        base: Tensor,
        changed: int,
        out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> tuple[Any, ...]:
        """The native core, kind tuple, per-chunk counts (checked against ``changed``) and
        output offsets, and the position/old/new arrays a native decode fills: ``out`` when
        given (a caller's slices of larger arrays), else new ones."""
        core = native.require()
        kt = native.kind_tuple(base.kind, base.n_elements)
        counts = core.table(kt, payload, base.n_elements)
        if sum(counts) != changed:
            raise PatchDecodeError("changed count does not match the header", codec=self.codec_id)
        offs = [0, *accumulate(counts)]
        dt = np.dtype(base.kind.elem_dtype)
        if out is not None:
            pos, old, new = out
            if not (
                pos.dtype == np.int64
                and old.dtype == new.dtype == dt
                and pos.shape == old.shape == new.shape == (changed,)
            ):
                raise ValueError("out: three arrays of `changed` positions and elements")
            return core, kt, counts, offs, pos, old, new
        return (
            core,
            kt,
            counts,
            offs,
            np.empty(changed, dtype=np.int64),
            np.empty(changed, dtype=dt),
            np.empty(changed, dtype=dt),
        )

    def decode(
        self, payload: memoryview, base: Tensor, changed: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._native():
            return decode_ref(base.kind, base.elements(), _single(base), payload, changed)
        core, kt, counts, offs, pos, old, new = self._outputs(payload, base, changed)

        def one(r: tuple[int, int]) -> None:
            a, b = r
            core.decode_range(kt, base.data, payload, a, b, counts[a:b], offs[a:b], pos, old, new)

        parallel_map(one, _ranges(len(counts), threads()))
        return pos, old, new

    def decode_into(
        self,
        payload: memoryview,
        base: Tensor,
        changed: int,
        out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]:
        """:meth:`decode`, writing each chunk's new elements into ``base`` in place right
        after decoding it (while its words are in cache); also returns the rp.sum128 change.

        All or nothing: on any error the tensor is left as it was and the error raised.
        The old elements are those the decoder read from ``base`` itself. ``out``: arrays
        to fill and return (int64 positions, old and new elements, ``changed`` each).
        """
        pos, old, new, change, _ = self._decode_into(payload, base, changed, False, out)
        return pos, old, new, change

    def can_hash(self) -> bool:
        """Whether the built core hashes in the decode pass (:meth:`decode_into_hashed`)."""
        return native.core is not None and bool(getattr(native.core, "DECODE_HASH", 0))

    def decode_into_hashed(
        self,
        payload: memoryview,
        base: Tensor,
        changed: int,
        out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int], tuple[int, int]]:
        """:meth:`decode_into`, and the tensor's rp.sum128 state after the write, hashed in
        the same pass: every word summed as the decoder reads it, before its writes, plus the
        change written (the re-hash without a second pass over the tensor)."""
        pos, old, new, change, state = self._decode_into(payload, base, changed, True, out)
        assert state is not None
        return pos, old, new, change, state

    def _decode_into(
        self,
        payload: memoryview,
        base: Tensor,
        changed: int,
        hashed: bool,
        out: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int], tuple[int, int] | None]:
        core, kt, counts, offs, pos, old, new = self._outputs(payload, base, changed, out)
        ranges = _ranges(len(counts), threads())

        args = (True, True) if hashed else (True,)

        def one(r: tuple[int, int]) -> tuple[int, ...] | BaseException:
            a, b = r
            try:
                return core.decode_range(
                    kt, base.data, payload, a, b, counts[a:b], offs[a:b], pos, old, new, *args
                )
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the undo
                return e

        results = parallel_map(one, ranges)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # the failing ranges put themselves back; undo the others
            for (a, b), res in zip(ranges, results, strict=True):
                if not isinstance(res, BaseException):
                    lo, hi = offs[a], offs[b]
                    core.apply(kt, base.data, pos[lo:hi], new[lo:hi], old[lo:hi])
            raise failed[0]
        change = (0, 0)
        state = (0, 0)
        for res in results:
            assert not isinstance(res, BaseException)
            change = sum_add(change, (res[0], res[1]))
            if hashed:
                state = sum_add(state, (res[2], res[3]))
        return pos, old, new, change, sum_add(state, change) if hashed else None


def _join(bodies: list[bytes]) -> bytes:
    """varint(len) + body per chunk, allocated once (the payload is held once more, briefly)."""
    parts: list[bytes] = []
    for b in bodies:
        head = bytearray()
        write_varint(head, len(b))
        parts += (bytes(head), b)
    return b"".join(parts)
