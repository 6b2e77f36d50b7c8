"""Slices: a rank publishes the part of a tensor it holds, never a gathered copy.

A trainer rank may hold a tensor whole (a plain tensor: the other ranks hold other names) or
an element range of it: an FSDP2 ``DTensor`` sharded along dim 0, or a :class:`TensorSlice`
it declares. A slice is cast, diffed and encoded as a tensor of its own shape under the
tensor's name (the patch bytes are ordinary patches over the rank's sub-view); the manifest
records where each slice lies (``Manifest.sliced``, schema 2), and followers decode each
shard's patch against the same range of the words they hold (:mod:`rollpatch.replay`).

The whole tensor's digest is needed without the whole tensor: rp.sum128 is a sum of per-word
terms at global word indices (docs/patch-format.md §7), so each rank sums the 8-byte words
that lie wholly inside its slice at their global indices (:func:`sum_at`: the native sum) and
sends the few bytes of words it shares with a neighbour; rank 0 adds the sums and the terms
of the re-joined words (:func:`combine`). Only elementwise casts can be sliced (bf16, fp16, or tensors a quantised
format leaves unquantised): a scale computed over a whole tensor or block cannot be.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import native
from ..errors import BoardError, ConfigError
from ..manifest import SlicedTensor, SliceEntry
from ..view import Tensor, View, sum128_digest, sum128_terms, sum_add

__all__ = ["SliceSpec", "TensorSlice", "combine", "cut", "slice_part", "split_slices", "sum_at"]

#: Words hashed per numpy pass (bounds the temporaries to a few times 8 MiB).
_CHUNK_WORDS = 1 << 20


@dataclass(frozen=True)
class TensorSlice:
    """A declared slice: ``tensor`` (numpy or torch) holds the elements
    ``[offset, offset + tensor.numel())`` of the flat, row-major tensor of ``shape``."""

    tensor: Any
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SliceSpec:
    """Where this rank's slice of a tensor lies: element ``offset`` in the whole ``shape``,
    published as a tensor of ``local_shape``."""

    offset: int
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    @property
    def length(self) -> int:
        return _numel(self.local_shape)


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def split_slices(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, SliceSpec]]:
    """The local tensors to snapshot (name → plain tensor) and where the sliced ones lie.

    DTensors: ``Shard(0)`` placements give a slice; ``Replicate`` is published whole by the
    mesh's coordinate 0 only; a rank whose shard is empty publishes nothing of that tensor.
    """
    local: dict[str, Any] = {}
    specs: dict[str, SliceSpec] = {}
    for name, value in state_dict.items():
        if isinstance(value, TensorSlice):
            arr, spec = value.tensor, _declared(name, value)
        elif type(value).__name__ == "DTensor" and type(value).__module__.startswith("torch"):
            got = _from_dtensor(name, value)
            if got is None:
                continue
            arr, spec = got
        else:
            local[name] = value
            continue
        if spec is None:
            local[name] = arr
        elif spec.length:
            local[name], specs[name] = arr, spec
    return local, specs


def _declared(name: str, s: TensorSlice) -> SliceSpec | None:
    shape = tuple(int(d) for d in s.shape)
    local_shape = tuple(int(d) for d in s.tensor.shape)
    n = _numel(local_shape)
    if not isinstance(s.offset, int) or s.offset < 0 or s.offset + n > _numel(shape):
        raise ConfigError(
            "TensorSlice lies outside its tensor",
            tensor=name,
            offset=s.offset,
            length=n,
            shape=shape,
        )
    if s.offset == 0 and local_shape == shape:
        return None  # the whole tensor
    return SliceSpec(s.offset, shape, local_shape)


def _from_dtensor(name: str, dt: Any) -> tuple[Any, SliceSpec | None] | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(dt.placements)
    mesh = dt.device_mesh
    if all(isinstance(p, Replicate) for p in placements):
        coords = mesh.get_coordinate()
        return (dt.to_local(), None) if coords is not None and not any(coords) else None
    if mesh.ndim != 1 or not (len(placements) == 1 and placements[0] == Shard(0)):
        raise ConfigError(
            "only DTensors sharded along dim 0 on a 1-D mesh (FSDP2) can be published as slices",
            tensor=name,
            placements=str(placements),
            hint="use fully_shard's default Shard(0), or declare TensorSlice values",
        )
    local = dt.to_local()
    shape = tuple(int(d) for d in dt.shape)
    _, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    row = _numel(shape[1:])
    spec = SliceSpec(int(offset[0]) * row, shape, tuple(int(d) for d in local.shape))
    if spec.offset == 0 and spec.local_shape == shape:
        return local, None
    return local, spec


def check_sliceable(view: View, specs: Mapping[str, SliceSpec], fmt: str) -> None:
    """Every sliced master was cast to one tensor of its name (an elementwise cast)."""
    for name, spec in specs.items():
        t = view.get(name)
        if t is None or t.shape != spec.local_shape or t.kind.packed:
            raise ConfigError(
                f"format {fmt} does not cast tensor {name!r} element by element, "
                "so it cannot be published as slices",
                tensor=name,
                format=fmt,
                hint="serve it in bf16/fp16, leave it out of quantisation (QuantPolicy), "
                "or publish it whole from one rank",
            )
        scales = [k for k in view if k != name and k.startswith(name) and k[len(name)] == "_"]
        if any(k.endswith(("_scale", "_scale_inv", "_global_scale")) for k in scales):
            raise ConfigError(
                f"format {fmt} quantises tensor {name!r} with scales: slices cannot be",
                tensor=name,
                format=fmt,
                hint="leave it out of quantisation (QuantPolicy), or publish it whole",
            )


def slice_part(t: Tensor, spec: SliceSpec) -> dict[str, Any]:
    """What rank 0 needs of one slice to compute the whole tensor's rp.sum128 digest: the
    sum of the words wholly inside the slice at their global indices, and the bytes of the
    (at most two) words it shares with neighbours."""
    raw = t.data.view(np.uint8)
    b0 = spec.offset * t.data.itemsize
    b1 = b0 + raw.size
    wa, wb = -(-b0 // 8), b1 // 8
    state = (0, 0)
    pieces: list[list[Any]] = []
    if wa <= wb:
        state = sum_at(raw[wa * 8 - b0 : wb * 8 - b0], wa)
        edges = [(b0, wa * 8), (wb * 8, b1)]
    else:  # the slice lies inside one word
        edges = [(b0, b1)]
    for lo, hi in edges:
        if hi > lo:
            pieces.append([lo, raw[lo - b0 : hi - b0].tobytes().hex()])
    return {
        "offset": spec.offset,
        "local_shape": list(spec.local_shape),
        "shape": list(spec.shape),
        "dtype": t.dtype,
        "sum": [state[0], state[1]],
        "pieces": pieces,
    }


def sum_at(data: np.ndarray, first_word: int) -> tuple[int, int]:
    """rp.sum128 state of whole 8-byte words ``data`` (uint8, a multiple of 8 bytes) that
    stand at word ``first_word`` of their tensor.

    The native sum numbers words from the start of the buffer it is given, so each chunk is
    copied to its own position in an anonymous mapping as long as the words before it; the
    pages below are never touched (never allocated) and each chunk's pages are returned after
    it is summed: one chunk of memory, at memcpy + native speed. Without the native core:
    :func:`rollpatch.view.sum128_terms` (numpy, ~40× slower).
    """
    n = data.size // 8
    if n == 0:
        return (0, 0)
    core = native.core
    mm = None
    if core is not None:
        try:  # address space only: pages are allocated when written (strict overcommit: no)
            mm = mmap.mmap(-1, 8 * (first_word + n), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            mm = None
    if core is None or mm is None:
        state = (0, 0)
        for w in range(0, n, _CHUNK_WORDS):
            end = min(w + _CHUNK_WORDS, n)
            words = data[w * 8 : end * 8].view("<u8")
            idx = np.arange(first_word + w, first_word + end, dtype=np.uint64)
            state = sum_add(state, sum128_terms(words, idx))
        return state
    total = 8 * (first_word + n)
    try:
        dest = np.frombuffer(mm, dtype=np.uint8)
        state = (0, 0)
        for w in range(0, n, _CHUNK_WORDS):
            c = min(_CHUNK_WORDS, n - w)
            lo = 8 * (first_word + w)
            dest[lo : lo + 8 * c] = data[8 * w : 8 * (w + c)]
            a, b = core.sum128(mm, first_word + w, c)
            state = sum_add(state, (a, b))
            start = lo - lo % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, start, min(total, lo + 8 * c) - start)
        del dest
    finally:
        mm.close()
    return state


def combine(name: str, parts: list[tuple[int, dict[str, Any]]]) -> SlicedTensor:
    """The manifest entry of a tensor from every shard's ``(shard, slice_part)``: the slices
    must agree on dtype and shape and tile the tensor; the digest is the whole tensor's."""

    parts = sorted(parts, key=lambda p: int(p[1]["offset"]))
    dtype, shape = parts[0][1]["dtype"], tuple(parts[0][1]["shape"])
    entries, at = [], 0
    state = (0, 0)
    shared: dict[int, bytearray] = {}
    for shard, p in parts:
        e = SliceEntry(shard, int(p["offset"]), tuple(p["local_shape"]))
        if p["dtype"] != dtype or tuple(p["shape"]) != shape:  # named as such (an audit)
            raise BoardError(
                "the ranks' slices of a tensor name different global shapes or dtypes",
                tensor=name,
                shard=shard,
                shape=tuple(p["shape"]),
                dtype=p["dtype"],
                first_shard_shape=shape,
                first_shard_dtype=dtype,
                hint="every rank's TensorSlice of one tensor must give the same global shape "
                "and dtype",
            )
        if e.offset != at:
            raise BoardError(
                "the ranks' slices of a tensor overlap or leave a gap",
                tensor=name,
                shard=shard,
                offset=e.offset,
                expected_offset=at,
                hint="every element of a sliced tensor must be held by exactly one rank",
            )
        at += e.length
        entries.append(e)
        state = sum_add(state, (int(p["sum"][0]), int(p["sum"][1])))
        for lo, hexed in p["pieces"]:
            data = bytes.fromhex(hexed)
            for i, byte in enumerate(data):  # at most 14 bytes per slice
                shared.setdefault((lo + i) // 8, bytearray(8))[(lo + i) % 8] = byte
    if at != _numel(shape):
        raise BoardError(
            "the ranks' slices do not cover the tensor", tensor=name, covered=at, shape=shape
        )
    if shared:
        idx = np.array(sorted(shared), dtype=np.uint64)
        words = np.frombuffer(b"".join(bytes(shared[int(i)]) for i in idx), dtype="<u8")
        state = sum_add(state, sum128_terms(words, idx))
    itemsize = _itemsize(dtype)
    digest = sum128_digest(dtype, shape, _numel(shape) * itemsize, state)
    return SlicedTensor(name, dtype, shape, digest, tuple(entries))


def _itemsize(dtype: str) -> int:
    from ..kinds import DTYPE_BYTES

    return int(DTYPE_BYTES[dtype])


def cut(t: Tensor, spec: SliceSpec | SliceEntry) -> Tensor:
    """The slice of a whole tensor's words (zero-copy) as a tensor of the slice's shape."""
    shape = spec.local_shape if isinstance(spec, SliceSpec) else spec.shape
    n = _numel(shape)
    return Tensor(t.kind, shape, t.data[spec.offset : spec.offset + n])
