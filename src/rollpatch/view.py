"""Views: name → served tensor (the exact words an engine holds), with digests.

A :class:`Tensor` is a flat, contiguous array of fixed-width unsigned words plus the
safetensors dtype and shape it is served as, and a :class:`~rollpatch.kinds.Kind` that says
how the codec reads its elements. A :class:`View` maps checkpoint names to tensors and keeps
per-tensor digests and one root digest (BLAKE3, hex).

Digests cover the dtype, the shape and the bytes — what an engine can recompute from what it
holds — never Python objects. The root digest binds the sorted (name, tensor digest) pairs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import blake3
import numpy as np

from .errors import ViewError
from .kinds import DTYPE_BYTES, Kind, get_kind

__all__ = ["Tensor", "View", "WordSource", "root_digest", "tensor_digest"]

_TENSOR_DOMAIN = b"rollpatch.tensor.v1\x00"
_ROOT_DOMAIN = b"rollpatch.view.v1\x00"


def tensor_digest(dtype: str, shape: tuple[int, ...], data: np.ndarray) -> str:
    """BLAKE3 digest (hex) of one served tensor: dtype, shape and raw little-endian bytes."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(_TENSOR_DOMAIN)
    h.update(f"{dtype}|{','.join(str(d) for d in shape)}\x00".encode())
    if data.size:
        h.update(memoryview(np.ascontiguousarray(data)).cast("B"))  # type: ignore[arg-type]
    return h.hexdigest()


def root_digest(tensor_digests: Mapping[str, str]) -> str:
    """Root digest (hex) of a view from its per-tensor digests."""
    h = blake3.blake3()
    h.update(_ROOT_DOMAIN)
    for name in sorted(tensor_digests):
        raw = name.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
        h.update(bytes.fromhex(tensor_digests[name]))
    return h.hexdigest()


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
            raise ViewError("tensor data must be a flat array of the kind's word dtype",
                            kind=self.kind.name, dtype=str(self.data.dtype))
        count = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        if count != self.data.size:
            raise ViewError("shape does not match the number of stored words",
                            shape=self.shape, words=self.data.size)
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

    def digest(self) -> str:
        return tensor_digest(self.dtype, self.shape, self.data)

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
            raise ViewError("array itemsize does not match the kind", kind=k.name,
                            itemsize=array.dtype.itemsize)
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

    def __init__(self, tensors: Mapping[str, Tensor] | None = None,
                 metadata: Mapping[str, str] | None = None) -> None:
        self._tensors: dict[str, Tensor] = dict(tensors or {})
        self._digests: dict[str, str] = {}
        self.metadata: dict[str, str] = dict(metadata or {})

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        self._tensors[name] = tensor
        self._digests.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self._tensors[name]
        self._digests.pop(name, None)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def tensor_digest(self, name: str) -> str:
        """The (cached) digest of one tensor."""
        d = self._digests.get(name)
        if d is None:
            d = self._digests[name] = self._tensors[name].digest()
        return d

    def tensor_digests(self) -> dict[str, str]:
        return {name: self.tensor_digest(name) for name in self._tensors}

    def digest(self) -> str:
        """The root digest of the view."""
        return root_digest(self.tensor_digests())

    def invalidate(self, name: str | None = None) -> None:
        """Forget cached digests (of one tensor, or all) after changing words directly."""
        if name is None:
            self._digests.clear()
        else:
            self._digests.pop(name, None)

    def set_digest(self, name: str, digest: str) -> None:
        """Record a digest already verified for the current words of ``name``."""
        self._digests[name] = digest

    def copy(self) -> View:
        out = View({k: t.copy() for k, t in self._tensors.items()}, self.metadata)
        out._digests = dict(self._digests)
        return out


def _numpy_dtype(dtype: str) -> np.dtype:
    import ml_dtypes

    table = {
        "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
        "F8_E8M0": ml_dtypes.float8_e8m0fnu, "U8": np.uint8, "I8": np.int8, "BOOL": np.bool_,
        "U16": np.uint16, "I16": np.int16, "U32": np.uint32, "I32": np.int32,
        "U64": np.uint64, "I64": np.int64,
    }
    return np.dtype(table[dtype])


def _kind_of(array: np.ndarray, kind: str | Kind | None) -> Kind:
    if isinstance(kind, Kind):
        return kind
    if kind is not None:
        return get_kind(kind)
    name = {
        "bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64",
        "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float8_e8m0fnu": "e8m0",
        "uint8": "u8", "int8": "i8", "bool": "bool", "uint16": "u16", "int16": "i16",
        "uint32": "u32", "int32": "i32", "uint64": "u64", "int64": "i64",
    }.get(array.dtype.name)
    if name is None:
        raise ViewError(f"no served kind for numpy dtype {array.dtype}",
                        hint="pass kind= explicitly")
    return get_kind(name)
