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

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .digests import (  # re-exported: the view's digests, named from here across the package
    _M64,
    DEFAULT_DIGEST,
    DigestAlgo,
    _sum128_numpy,  # noqa: F401 - re-exported for the tests' reference sums
    root_digest,
    sum128,
    sum128_at,
    sum128_digest,
    sum128_terms,
    sum_add,
    tensor_digest,
)
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
    "sum128_at",
    "sum128_digest",
    "sum128_terms",
    "sum_add",
    "tensor_digest",
]


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
