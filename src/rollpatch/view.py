"""Views: name → served tensor (the exact words an engine holds), with digests.

A :class:`Tensor` is a flat, contiguous array of fixed-width unsigned words plus the
safetensors dtype and shape it is served as, and a :class:`~rollpatch.kinds.Kind` that says
how the codec reads its elements. A :class:`View` maps checkpoint names to tensors and keeps
per-tensor digests and one root digest (64 hex characters).

Digests cover the dtype, the shape and the bytes — what an engine can recompute from what it
holds — never Python objects. The root digest binds the sorted (name, tensor digest) pairs.
Two algorithms (docs/patch-format.md §7): ``rp.sum128.v1`` (the default: a 128-bit additive
checksum at memory speed, finalised with BLAKE3 over its state; it guards against faults, not
forgers — objects on the board carry BLAKE3 for that) and ``rp.blake3.v1`` (patch format 1).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import blake3
import numpy as np

from . import native
from .errors import ViewError
from .kinds import DTYPE_BYTES, Kind, get_kind

__all__ = [
    "DEFAULT_DIGEST",
    "DigestAlgo",
    "Tensor",
    "View",
    "WordSource",
    "root_digest",
    "sum128",
    "sum128_digest",
    "tensor_digest",
]

DigestAlgo = Literal["rp.sum128.v1", "rp.blake3.v1"]
DEFAULT_DIGEST: DigestAlgo = "rp.sum128.v1"
_TENSOR_DOMAIN = {
    "rp.blake3.v1": b"rollpatch.tensor.v1\x00",
    "rp.sum128.v1": b"rollpatch.tensor.sum128.v1\x00",
}
_ROOT_DOMAIN = {"rp.blake3.v1": b"rollpatch.view.v1\x00", "rp.sum128.v1": b"rollpatch.view.v2\x00"}
_SUM_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_SUM_S = (0x243F6A8885A308D3, 0x13198A2E03707344)
_SUM_ROT = (32, 17)
_M64 = (1 << 64) - 1
#: Words per thread task when hashing one large tensor (the sum is additive over ranges).
_SUM_SPLIT = 1 << 23


def sum128_terms(words: np.ndarray, index: np.ndarray) -> tuple[int, int]:
    """rp.sum128 state contribution of 8-byte ``words`` (uint64) standing at word ``index``
    (uint64, same length): Σ of both lanes' per-word terms, mod 2^64 (§7.1). Sums over any
    words add up, so the change of a write is terms(after) - terms(before) of its words."""
    out = []
    with np.errstate(over="ignore"):
        for lane in (0, 1):
            x = words ^ (np.uint64(_SUM_S[lane]) + index * np.uint64(_SUM_K[lane]))
            r = np.uint64(_SUM_ROT[lane])
            term = (x & np.uint64(0xFFFFFFFF)) * (x >> np.uint64(32)) + (
                (words << r) | (words >> (np.uint64(64) - r))
            )
            out.append(int(term.sum(dtype=np.uint64)))
    return out[0], out[1]


def _sum128_numpy(raw: np.ndarray) -> tuple[int, int]:
    """Reference rp.sum128 state of bytes ``raw`` (uint8), zero-padded to 8-byte words."""
    pad = (-raw.size) % 8
    w = np.concatenate([raw, np.zeros(pad, np.uint8)]).view("<u8") if pad else raw.view("<u8")
    return sum128_terms(w, np.arange(w.size, dtype=np.uint64))


def sum_add(state: tuple[int, int], change: tuple[int, int]) -> tuple[int, int]:
    """An rp.sum128 state plus a change (each lane modulo 2^64): the state is additive."""
    return (state[0] + change[0]) & _M64, (state[1] + change[1]) & _M64


def sum128(data: np.ndarray) -> tuple[int, int]:
    """The rp.sum128 state (two 64-bit sums) of a contiguous array's bytes."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    core = native.core
    if core is None:
        return _sum128_numpy(raw)
    words = (raw.size + 7) // 8
    if words <= _SUM_SPLIT:
        return tuple(core.sum128(raw, 0, words))
    parts = native.parallel_map(
        lambda w0: core.sum128(raw, w0, min(_SUM_SPLIT, words - w0)),
        list(range(0, words, _SUM_SPLIT)),
    )
    return sum(a for a, _ in parts) & _M64, sum(b for _, b in parts) & _M64


@functools.lru_cache(maxsize=4096)
def _header(algo: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    """The digest's domain, dtype and shape bytes (cached: a view has few distinct layouts,
    and every apply digests each touched tensor from its state)."""
    return _TENSOR_DOMAIN[algo] + f"{dtype}|{','.join(str(d) for d in shape)}\x00".encode()


def sum128_digest(dtype: str, shape: tuple[int, ...], nbytes: int, state: tuple[int, int]) -> str:
    """The rp.sum128.v1 digest of a tensor from its sum state (docs/patch-format.md §7)."""
    return blake3.blake3(
        _header("rp.sum128.v1", dtype, shape)
        + nbytes.to_bytes(8, "little")
        + state[0].to_bytes(8, "little")
        + state[1].to_bytes(8, "little")
    ).hexdigest()


def tensor_digest(
    dtype: str, shape: tuple[int, ...], data: np.ndarray, algo: DigestAlgo = DEFAULT_DIGEST
) -> str:
    """Digest (64 hex) of one served tensor: dtype, shape and raw little-endian bytes."""
    if algo == "rp.sum128.v1":
        return sum128_digest(dtype, shape, int(data.nbytes), sum128(data))
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(_header(algo, dtype, shape))
    if data.size:
        h.update(memoryview(np.ascontiguousarray(data)).cast("B"))  # type: ignore[arg-type]
    return h.hexdigest()


def root_digest(tensor_digests: Mapping[str, str], algo: DigestAlgo = DEFAULT_DIGEST) -> str:
    """Root digest (hex) of a view from its per-tensor digests."""
    parts = [_ROOT_DOMAIN[algo]]
    for name in sorted(tensor_digests):  # the same bytes as one update each, hashed at once
        raw = name.encode()
        parts += (len(raw).to_bytes(4, "little"), raw, bytes.fromhex(tensor_digests[name]))
    return blake3.blake3(b"".join(parts)).hexdigest()


@dataclass(eq=False)
class Tensor:
    """One served tensor: ``data`` is a flat contiguous array of ``kind.word_dtype`` words."""

    kind: Kind
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in self.shape):
            raise ViewError("negative dimension in shape", shape=self.shape)
        if self.data.dtype != self.kind.word_dtype or self.data.ndim != 1:
            raise ViewError(
                "tensor data must be a flat array of the kind's word dtype",
                kind=self.kind.name,
                dtype=str(self.data.dtype),
            )
        count = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        if count != self.data.size:
            raise ViewError(
                "shape does not match the number of stored words",
                shape=self.shape,
                words=self.data.size,
            )
        if not self.data.flags.c_contiguous:
            raise ViewError("tensor data must be contiguous", kind=self.kind.name)

    @property
    def dtype(self) -> str:
        """The safetensors dtype code the tensor is stored as."""
        return self.kind.dtype

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        """Number of coded elements (two per byte for packed 4-bit kinds)."""
        return self.data.size * 2 if self.kind.packed else self.data.size

    def elements(self) -> np.ndarray:
        """The elements as unsigned ints; a view of ``data`` unless the kind is packed."""
        if not self.kind.packed:
            return self.data
        out = np.empty(self.data.size * 2, dtype=np.uint8)
        out[0::2] = self.data & 0x0F
        out[1::2] = self.data >> 4
        return out

    def digest(self, algo: DigestAlgo = DEFAULT_DIGEST) -> str:
        return tensor_digest(self.dtype, self.shape, self.data, algo)

    def copy(self) -> Tensor:
        return Tensor(self.kind, self.shape, self.data.copy())

    @classmethod
    def from_array(cls, array: np.ndarray, kind: str | Kind | None = None) -> Tensor:
        """Wrap a numpy array (of any dtype with the right itemsize) as a served tensor.

        ``kind`` defaults from the array's dtype (bfloat16/float8 via ml_dtypes included).
        """
        k = _kind_of(array, kind)
        nbytes = DTYPE_BYTES[k.dtype]
        if array.dtype.itemsize != nbytes:
            raise ViewError(
                "array itemsize does not match the kind", kind=k.name, itemsize=array.dtype.itemsize
            )
        data = np.ascontiguousarray(array).reshape(-1).view(k.word_dtype)
        return cls(k, tuple(array.shape), data)

    def to_array(self) -> np.ndarray:
        """The words reshaped to the served shape, as the closest numpy dtype (no copy)."""
        return self.data.view(_numpy_dtype(self.dtype)).reshape(self.shape)


class WordSource(Protocol):
    """Anything that can lend a tensor's words by name: a View, or an engine's memory."""

    def __contains__(self, name: object) -> bool: ...
    def __getitem__(self, name: str) -> Tensor: ...


class View(Mapping[str, Tensor]):
    """A served view: name → :class:`Tensor`, with cached per-tensor digests.

    Cached digests stay valid as long as tensors are changed only through
    :func:`rollpatch.patch.apply` (which updates them) or after :meth:`invalidate`.
    """

    def __init__(
        self, tensors: Mapping[str, Tensor] | None = None, metadata: Mapping[str, str] | None = None
    ) -> None:
        self._tensors: dict[str, Tensor] = dict(tensors or {})
        self._digests: dict[str, str] = {}
        self._legacy: dict[str, str] = {}  # rp.blake3.v1 digests (patch format 1)
        self._sums: dict[str, tuple[int, int]] = {}  # rp.sum128 states, for O(change) updates
        self.metadata: dict[str, str] = dict(metadata or {})

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __contains__(self, name: object) -> bool:  # Mapping's goes through __getitem__ and a
        return name in self._tensors  # KeyError: ~1 us, ~4 per tensor in encode and apply

    def __len__(self) -> int:
        return len(self._tensors)

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        self._tensors[name] = tensor
        self.invalidate(name)

    def __delitem__(self, name: str) -> None:
        del self._tensors[name]
        self.invalidate(name)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def _cache(self, algo: DigestAlgo) -> dict[str, str]:
        return self._digests if algo == DEFAULT_DIGEST else self._legacy

    def tensor_digest(self, name: str, algo: DigestAlgo = DEFAULT_DIGEST) -> str:
        """The (cached) digest of one tensor."""
        cache = self._cache(algo)
        d = cache.get(name)
        if d is None:
            t = self._tensors[name]
            if algo == "rp.sum128.v1":
                d = sum128_digest(t.dtype, t.shape, t.nbytes, self.sum_state(name))
            else:
                d = t.digest(algo)
            cache[name] = d
        return d

    def sum_state(self, name: str) -> tuple[int, int]:
        """The (cached) rp.sum128 state of one tensor."""
        st = self._sums.get(name)
        if st is None:
            st = self._sums[name] = sum128(self._tensors[name].data)
        return st

    def cached_sum_state(self, name: str) -> tuple[int, int] | None:
        """The rp.sum128 state of one tensor if it is known, without hashing."""
        return self._sums.get(name)

    def update_sum_state(self, name: str, state: tuple[int, int]) -> None:
        """Record the sum state after a change whose effect on the sums was computed from the
        words before and after it (``rollpatch.patch.apply``); the digest follows from it."""
        self.invalidate(name)
        self._sums[name] = state

    def carry_sums(self, base: View, changes: Mapping[str, tuple[int, int]]) -> None:
        """This view's rp.sum128 states from ``base``'s, for tensors of the same layout in
        both: each named tensor's words are ``base``'s plus words whose sum change is given
        (found by comparing every word, so the state is exact). An unchanged state also
        carries ``base``'s digest, which is a function of layout and state. Tensors whose
        state is known here already, or not known in ``base``, are left alone. One loop over
        the dicts: an encoder calls this for every tensor of a view after its native pass."""
        sums, bsums, bdig, dig, legacy = (
            self._sums,
            base._sums,
            base._digests,
            self._digests,
            self._legacy,
        )
        for name, (d0, d1) in changes.items():
            st = bsums.get(name)
            if st is None or name in sums:
                continue
            legacy.pop(name, None)
            d = bdig.get(name) if d0 == d1 == 0 else None
            if d is None:
                dig.pop(name, None)
                sums[name] = ((st[0] + d0) & _M64, (st[1] + d1) & _M64)
            else:
                dig[name] = d
                sums[name] = st

    def tensor_digests(self, algo: DigestAlgo = DEFAULT_DIGEST) -> dict[str, str]:
        return {name: self.tensor_digest(name, algo) for name in self._tensors}

    def digest(self, algo: DigestAlgo = DEFAULT_DIGEST) -> str:
        """The root digest of the view."""
        cache = self._cache(algo)
        if cache.keys() == self._tensors.keys():  # every digest known: no call per tensor
            return root_digest(cache, algo)
        return root_digest(self.tensor_digests(algo), algo)

    def invalidate(self, name: str | None = None) -> None:
        """Forget cached digests (of one tensor, or all) after changing words directly."""
        if name is None:
            self._digests.clear()
            self._legacy.clear()
            self._sums.clear()
        else:
            self._digests.pop(name, None)
            self._legacy.pop(name, None)
            self._sums.pop(name, None)

    def set_digest(self, name: str, digest: str, algo: DigestAlgo = DEFAULT_DIGEST) -> None:
        """Record a digest already verified for the current words of ``name``."""
        self._cache(algo)[name] = digest

    def copy(self) -> View:
        out = View({k: t.copy() for k, t in self._tensors.items()}, self.metadata)
        out._digests = dict(self._digests)
        out._legacy = dict(self._legacy)
        out._sums = dict(self._sums)
        return out


def _numpy_dtype(dtype: str) -> np.dtype:
    import ml_dtypes

    table = {
        "BF16": ml_dtypes.bfloat16,
        "F16": np.float16,
        "F32": np.float32,
        "F64": np.float64,
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
        "F8_E8M0": ml_dtypes.float8_e8m0fnu,
        "U8": np.uint8,
        "I8": np.int8,
        "BOOL": np.bool_,
        "U16": np.uint16,
        "I16": np.int16,
        "U32": np.uint32,
        "I32": np.int32,
        "U64": np.uint64,
        "I64": np.int64,
    }
    return np.dtype(table[dtype])


def _kind_of(array: np.ndarray, kind: str | Kind | None) -> Kind:
    if isinstance(kind, Kind):
        return kind
    if kind is not None:
        return get_kind(kind)
    name = {
        "bfloat16": "bf16",
        "float16": "f16",
        "float32": "f32",
        "float64": "f64",
        "float8_e4m3fn": "e4m3",
        "float8_e5m2": "e5m2",
        "float8_e8m0fnu": "e8m0",
        "uint8": "u8",
        "int8": "i8",
        "bool": "bool",
        "uint16": "u16",
        "int16": "i16",
        "uint32": "u32",
        "int32": "i32",
        "uint64": "u64",
        "int64": "i64",
    }.get(array.dtype.name)
    if name is None:
        raise ViewError(
            f"no served kind for numpy dtype {array.dtype}", hint="pass kind= explicitly"
        )
    return get_kind(name)
