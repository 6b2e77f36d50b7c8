"""What a TP rank shares after decoding a tensor for the others (:mod:`.tpdecode`): the
decoded delta and the rp.sum128 change of its writes, or the error it met, as bytes.

Layout (little-endian): a 32-byte head ``status u8`` (0 a result, 1 an error), ``width u8``
(bytes per position: 4 where every position of the tensor fits, else 8), ``has u8`` (1: the
change follows), 5 zero bytes, ``k u64`` (changes; for an error the JSON's length), the change
as two ``u64`` lanes; then the positions, the old words and the new words (the kind's element
dtype), or the error as JSON (class, message, hint, context; at most ``ERROR_ROOM`` bytes).
The bytes travel between the ranks of one engine only; :func:`unpack` still checks every
length against the tensor before it reads, and raises the owner's error as its own class.

Sent point to point (:func:`restrict`), a result holds the changes in the receiving rank's
block only, with the change of the whole tensor's writes; :func:`within` checks a received
one against the receiver's block.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from ...errors import EngineError, RollpatchError, engine_error, error_report
from ...kinds import KINDS
from ...patch import TensorPatch
from ...patch.model import DeltaOp
from ..sumchange import SumState
from .layout import Placement, locate, row_span

__all__ = ["ERROR_ROOM", "bound", "pack", "pack_error", "restrict", "unpack", "within"]

#: Bytes of JSON an owner may use to share an error.
ERROR_ROOM = 2048
_HEAD = struct.Struct("<BBB5xQQQ")


def _width(n_elements: int) -> int:
    """Bytes per shared position: 4 where every position of the tensor fits."""
    return 8 if n_elements > 1 << 32 else 4


def _elements(e: dict[str, Any]) -> int:
    return int(np.prod(e["shape"], dtype=np.int64)) * (2 if KINDS[e["kind"]].packed else 1)


def pack(tp: TensorPatch, change: SumState | None) -> bytes:
    """A decoded delta and the rp.sum128 change of its writes (None: not measured) as the
    bytes its owner shares: head, positions (4 bytes each where the tensor's fit), old
    words, new words."""
    pos, old, new = tp.changes()
    p = pos.astype(np.int64 if _width(tp.n_elements) == 8 else np.uint32, copy=False)
    d0, d1 = change if change is not None else (0, 0)
    head = _HEAD.pack(0, p.itemsize, change is not None, pos.size, d0, d1)
    return b"".join((head, p.tobytes(), old.tobytes(), new.tobytes()))


def restrict(tp: TensorPatch, pl: Placement) -> TensorPatch:
    """``tp``'s changes at the checkpoint positions a rank holds (``pl``: its placement): a
    row block's are one slice of the sorted positions (no copy), a column block's a mask.
    ``tp`` itself where the rank holds the tensor whole, an expert's slot, or a packed kind."""
    if pl.whole or pl.sub is not None or tp.kind.packed:
        return tp
    pos, old, new = tp.changes()
    span = row_span(pl, pos)
    keep: Any = span if span is not None else locate(pl, pos)[0]
    op = DeltaOp(pos[keep], old[keep], new[keep])
    return TensorPatch(tp.name, tp.kind, tp.shape, tp.base_digest, tp.target_digest, op)


def within(tp: TensorPatch, pl: Placement) -> bool:
    """Whether every change of ``tp`` lies in the block ``pl`` holds (a result received
    point to point; its order and bounds are checked when it is staged)."""
    pos = tp.changes().positions
    if pl.whole or pl.sub is not None or tp.kind.packed or not pos.size:
        return True  # what restrict() sends whole
    return bool(locate(pl, pos)[0].all())


def pack_error(err: BaseException, rank: int) -> bytes:
    """An owner's failure as the bytes it shares instead of a result: its
    :func:`~rollpatch.errors.error_report` with the owner's rank, as at most ``ERROR_ROOM``
    bytes of JSON after the head."""
    body = error_report(err)
    body["context"] = {**body.get("context", {}), "rank": rank}
    text = json.dumps(body).encode()
    if len(text) > ERROR_ROOM:  # the message cut, the context reduced to the rank
        body = {**body, "message": str(body["message"])[:500], "hint": None}
        body["context"] = {"rank": rank}
        text = json.dumps(body).encode()[:ERROR_ROOM]
    return _HEAD.pack(1, 0, 0, len(text), 0, 0) + text


def unpack(e: dict[str, Any], data: memoryview | bytes) -> tuple[TensorPatch, SumState | None]:
    """The delta of ``e`` (a header entry, or a chain's tensor: ``name``, ``kind``,
    ``shape``, ``base``, ``target``, ``changed``: the count a single step's header gives, None
    for a chain's) and its rp.sum128 change (None: not measured) from its owner's bytes, which
    must be exactly one result or one error (the shares are cut at the lengths the owners
    announced: a byte more or less is a malformed share); the owner's error raised."""
    name, kind, shape = e["name"], KINDS[e["kind"]], tuple(e["shape"])
    if len(data) < _HEAD.size:
        raise EngineError("a rank shared a truncated result", tensor=name)
    status, width, has, k, d0, d1 = _HEAD.unpack_from(data)
    if status == 1 and k == len(data) - _HEAD.size:
        raise _error(bytes(data[_HEAD.size : _HEAD.size + k]), name)
    size = kind.elem_dtype.itemsize
    if (
        status != 0
        or width != _width(_elements(e))
        or has > 1
        or (e["changed"] is not None and k != e["changed"])
        or k > _elements(e)
        or len(data) != _HEAD.size + k * (width + 2 * size)
    ):
        raise EngineError("a rank shared a malformed result", tensor=name)
    at = _HEAD.size
    pos = np.frombuffer(data, np.uint32 if width == 4 else np.int64, k, at).astype(np.int64)
    at += k * width
    old = np.frombuffer(data, kind.elem_dtype, k, at).copy()
    new = np.frombuffer(data, kind.elem_dtype, k, at + k * size).copy()
    tp = TensorPatch(name, kind, shape, e["base"], e["target"], DeltaOp(pos, old, new))
    return tp, ((d0, d1) if has else None)


def _error(body: bytes, name: str) -> RollpatchError:
    """The owner's error (:func:`pack_error`) as its own class (:func:`engine_error`)."""
    try:
        report = json.loads(body)
        if not isinstance(report, dict):
            raise TypeError("not an object")
        report["context"] = {"tensor": name, **dict(report.get("context") or {})}
        return engine_error(report, engine=None, what=f"rank {report['context'].get('rank')}")
    except (ValueError, TypeError):
        return EngineError("a rank failed to decode a tensor", tensor=name)


def bound(e: dict[str, Any]) -> int:
    """The most bytes an owner may share for ``e`` (a length from another rank is checked
    against it before anything is allocated)."""
    n = _elements(e)
    return _HEAD.size + max(n * (_width(n) + 2 * KINDS[e["kind"]].elem_dtype.itemsize), ERROR_ROOM)
