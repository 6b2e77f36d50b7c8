"""The decoded, in-memory patch: per tensor, changed positions with old and new elements.

A decoded patch is self-contained (it carries old elements too), so it can be composed,
inverted and inspected without any view. Its wire form (``rollpatch.patch.wire``) drops the old
elements: the decoder reads them from the base view it is applied to.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

from ..errors import PatchError
from ..kinds import Kind
from ..view import DEFAULT_DIGEST, DigestAlgo, Tensor

__all__ = ["OPS", "DeltaOp", "DropOp", "FullOp", "Op", "Patch", "TensorOp", "TensorPatch"]

#: Tensor operations: ``delta`` (same kind/shape), ``full`` (new or reshaped), ``drop``.
#: A closed set: the type checker rejects any other spelling where an op is built or compared.
TensorOp = Literal["delta", "full", "drop"]
OPS: tuple[TensorOp, ...] = ("delta", "full", "drop")


@dataclass(frozen=True, eq=False, slots=True)
class DeltaOp:
    """Same kind and shape: changed ``positions`` (int64, strictly increasing element
    indices) with their ``old`` and ``new`` elements (``kind.elem_dtype``, ``old != new``)."""

    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray
    op: ClassVar[Literal["delta"]] = "delta"

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter((self.positions, self.old, self.new))


@dataclass(frozen=True, eq=False, slots=True)
class FullOp:
    """A new or reshaped tensor: ``tensor`` holds it whole."""

    tensor: Tensor
    op: ClassVar[Literal["full"]] = "full"


@dataclass(frozen=True, slots=True)
class DropOp:
    """The tensor is gone: no payload."""

    op: ClassVar[Literal["drop"]] = "drop"


#: One tensor's operation with exactly its payload: ``match`` (or ``isinstance``) proves the
#: fields, so no consumer narrows an optional.
Op = DeltaOp | FullOp | DropOp


@dataclass(frozen=True, eq=False, slots=True)
class TensorPatch:
    """One tensor's transition: ``change`` is the operation with its payload.

    ``base_digest`` is the tensor's digest before (None for a new tensor), ``target_digest``
    after (None for a drop).
    """

    name: str
    kind: Kind
    shape: tuple[int, ...]
    base_digest: str | None
    target_digest: str | None
    change: Op

    def __post_init__(self) -> None:  # isinstance, not match: built once per changed tensor
        c = self.change
        if isinstance(c, DeltaOp):
            if not (c.positions.shape == c.old.shape == c.new.shape):
                raise PatchError("positions/old/new lengths differ", tensor=self.name)
        elif not isinstance(c, (FullOp, DropOp)):
            raise PatchError(f"unknown tensor op {c!r}", tensor=self.name)

    @property
    def op(self) -> TensorOp:
        """The operation's name, as the wire header spells it."""
        return self.change.op

    def changes(self) -> DeltaOp:
        """The payload of a ``delta`` op (PatchError for another op)."""
        if not isinstance(self.change, DeltaOp):
            raise PatchError(f"a {self.op} op has no changed positions", tensor=self.name)
        return self.change

    def full_tensor(self) -> Tensor:
        """The new tensor of a ``full`` op (PatchError for another op)."""
        if not isinstance(self.change, FullOp):
            raise PatchError(f"a {self.op} op carries no tensor", tensor=self.name)
        return self.change.tensor

    @property
    def n_changed(self) -> int:
        """Changed elements (delta), or the element count of the new/old tensor."""
        match self.change:
            case DeltaOp(positions):
                return int(positions.size)
            case FullOp(tensor):
                return tensor.n_elements
        return self.n_elements

    @property
    def n_elements(self) -> int:
        n = int(np.prod(self.shape, dtype=np.int64))
        return n * 2 if self.kind.packed else n

    def equals(self, other: TensorPatch) -> bool:
        """Structural, bitwise equality (used by tests and compose checks)."""
        if (self.name, self.op, self.kind, self.shape, self.base_digest, self.target_digest) != (
            other.name,
            other.op,
            other.kind,
            other.shape,
            other.base_digest,
            other.target_digest,
        ):
            return False
        a, b = self.change, other.change
        if isinstance(a, DeltaOp) and isinstance(b, DeltaOp):
            return all(np.array_equal(x, y) for x, y in zip(a, b))
        if isinstance(a, FullOp) and isinstance(b, FullOp):
            return np.array_equal(a.tensor.data, b.tensor.data)
        return isinstance(a, DropOp) and isinstance(b, DropOp)


@dataclass(frozen=True, eq=False)
class Patch:
    """A lossless transition between two views, bound to their root digests."""

    base: str
    target: str
    tensors: Mapping[str, TensorPatch]
    meta: Mapping[str, str] = field(default_factory=dict)
    #: The view digest algorithm of ``base``, ``target`` and every tensor digest.
    digest: DigestAlgo = DEFAULT_DIGEST

    @property
    def n_changed(self) -> int:
        """Changed elements over all delta tensors."""
        return sum(t.n_changed for t in self.tensors.values() if isinstance(t.change, DeltaOp))

    def equals(self, other: Patch) -> bool:
        """Bitwise equality of two decoded patches (ignores ``meta``)."""
        return (
            self.base == other.base
            and self.target == other.target
            and self.digest == other.digest
            and sorted(self.tensors) == sorted(other.tensors)
            and all(t.equals(other.tensors[n]) for n, t in self.tensors.items())
        )

    def inverse(self) -> Patch:
        """The reverse transition target → base (delta tensors only swap old and new)."""
        out = {}
        for name, t in self.tensors.items():
            if not isinstance(t.change, DeltaOp):
                raise PatchError(
                    "only delta patches can be inverted without the base view", tensor=name
                )
            ch = t.change
            out[name] = TensorPatch(
                name,
                t.kind,
                t.shape,
                t.target_digest,
                t.base_digest,
                DeltaOp(ch.positions, ch.new, ch.old),
            )
        return Patch(self.target, self.base, out, dict(self.meta), self.digest)
