"""The decoded, in-memory patch: per tensor, changed positions with old and new elements.

A decoded patch is self-contained (it carries old elements too), so it can be composed,
inverted and inspected without any view. Its wire form (``rollpatch.patch.wire``) drops the old
elements: the decoder reads them from the base view it is applied to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from ..errors import PatchError
from ..kinds import Kind
from ..view import DEFAULT_DIGEST, DigestAlgo, Tensor

__all__ = ["OPS", "Changes", "Patch", "TensorOp", "TensorPatch"]

#: Tensor operations: ``delta`` (same kind/shape), ``full`` (new or reshaped), ``drop``.
#: A closed set: the type checker rejects any other spelling where an op is built or compared.
TensorOp = Literal["delta", "full", "drop"]
OPS: tuple[TensorOp, ...] = ("delta", "full", "drop")


class Changes(NamedTuple):
    """A ``delta`` op's payload: changed positions with their old and new elements."""

    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray


@dataclass(frozen=True, eq=False)
class TensorPatch:
    """One tensor's transition.

    ``delta``: ``positions`` (int64, strictly increasing element indices), ``old`` and ``new``
    (elements as ``kind.elem_dtype``, ``old != new`` everywhere). ``full``: ``tensor`` holds the
    new tensor. ``drop``: nothing. ``base_digest`` is the tensor's digest before (None for a new
    tensor), ``target_digest`` after (None for a drop).
    """

    name: str
    op: TensorOp
    kind: Kind
    shape: tuple[int, ...]
    base_digest: str | None
    target_digest: str | None
    positions: np.ndarray | None = None
    old: np.ndarray | None = None
    new: np.ndarray | None = None
    tensor: Tensor | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise PatchError(f"unknown tensor op {self.op!r}", tensor=self.name)
        if self.op == "delta":
            if self.positions is None or self.old is None or self.new is None:
                raise PatchError("delta needs positions, old and new", tensor=self.name)
            if not (self.positions.shape == self.old.shape == self.new.shape):
                raise PatchError("positions/old/new lengths differ", tensor=self.name)
        if self.op == "full" and self.tensor is None:
            raise PatchError("full op needs a tensor", tensor=self.name)

    def changes(self) -> Changes:
        """The payload of a ``delta`` op, typed (PatchError for another op)."""
        if self.op != "delta" or self.positions is None or self.old is None or self.new is None:
            raise PatchError(f"a {self.op} op has no changed positions", tensor=self.name)
        return Changes(self.positions, self.old, self.new)

    def full_tensor(self) -> Tensor:
        """The new tensor of a ``full`` op, typed (PatchError for another op)."""
        if self.op != "full" or self.tensor is None:
            raise PatchError(f"a {self.op} op carries no tensor", tensor=self.name)
        return self.tensor

    @property
    def n_changed(self) -> int:
        """Changed elements (delta), or the element count of the new/old tensor."""
        if self.op == "delta":
            return int(self.changes().positions.size)
        if self.op == "full":
            return self.full_tensor().n_elements
        n = int(np.prod(self.shape, dtype=np.int64))
        return n * 2 if self.kind.packed else n

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
        if self.op == "delta":
            return all(np.array_equal(a, b) for a, b in zip(self.changes(), other.changes()))
        if self.op == "full":
            return np.array_equal(self.full_tensor().data, other.full_tensor().data)
        return True


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
        return sum(t.n_changed for t in self.tensors.values() if t.op == "delta")

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
            if t.op != "delta":
                raise PatchError(
                    "only delta patches can be inverted without the base view", tensor=name
                )
            out[name] = TensorPatch(
                name,
                "delta",
                t.kind,
                t.shape,
                t.target_digest,
                t.base_digest,
                t.positions,
                t.new,
                t.old,
            )
        return Patch(self.target, self.base, out, dict(self.meta), self.digest)
