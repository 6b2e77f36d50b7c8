"""The decoded-patch file: how the adapter hands a *decoded* patch to vLLM's workers.

A safetensors file (parsed by rollpatch's bounded reader; no pickle) whose
``__metadata__["rollpatch.decoded"]`` is a JSON object::

    {"format": "rollpatch.decoded", "version": 1, "base": <root hex>, "target": <root hex>,
     "meta": {str: str},
     "tensors": [{"name": str, "op": "delta" | "full", "kind": str, "shape": [int, ...],
                  "base": <hex>, "target": <hex>, "changed": int}, ...]}

and, for entry ``i``: ``t{i}.pos`` (I64, ``[changed]``, strictly increasing element indices),
``t{i}.old`` and ``t{i}.new`` (``[changed]``, the kind's dtype) for a delta, or ``t{i}.full``
(the whole new tensor, flat) for a full op. Rules: at most :data:`MAX_TENSORS` entries; names
unique, non-empty, at most 1024 bytes; digests 64 lowercase hex; every array present with the
stated dtype and length; no other arrays. Readers MUST reject anything else before touching
the engine. Positions' range and order are checked by the engine against its own shapes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import PatchDecodeError, ViewError
from ...io.safetensors import load_view, view_to_bytes
from ...kinds import KINDS, get_kind
from ...patch import DeltaOp, DropOp, FullOp, Patch, TensorPatch
from ...view import Tensor, View

__all__ = ["MAX_TENSORS", "read_decoded", "write_decoded"]

MAX_TENSORS = 1_000_000
_KEY = "rollpatch.decoded"
_HEX = re.compile(r"^[0-9a-f]{64}$")


def write_decoded(patch: Patch, path: str | Path) -> int:
    """Write ``patch`` (delta and full ops) to ``path``; returns the file size in bytes."""
    tensors: dict[str, Tensor] = {}
    entries: list[dict[str, Any]] = []
    for i, name in enumerate(sorted(patch.tensors)):
        tp = patch.tensors[name]
        match tp.change:
            case DeltaOp(positions, old, new):
                n = int(positions.size)
                tensors[f"t{i}.pos"] = Tensor(
                    KINDS["i64"], (n,), positions.astype(np.int64).view(np.uint64)
                )
                tensors[f"t{i}.old"] = Tensor(tp.kind, (n,), np.ascontiguousarray(old))
                tensors[f"t{i}.new"] = Tensor(tp.kind, (n,), np.ascontiguousarray(new))
            case FullOp(tensor):
                n = tensor.data.size
                tensors[f"t{i}.full"] = Tensor(tp.kind, (n,), tensor.data)
            case DropOp():
                raise PatchDecodeError(
                    "the engine's tensor set is fixed: cannot drop a tensor", tensor=name
                )
        entries.append(
            {
                "name": name,
                "op": tp.op,
                "kind": tp.kind.name,
                "shape": list(tp.shape),
                "base": tp.base_digest,
                "target": tp.target_digest,
                "changed": n,
            }
        )
    head = {
        "format": _KEY,
        "version": 1,
        "base": patch.base,
        "target": patch.target,
        "meta": dict(patch.meta),
        "tensors": entries,
    }
    raw = view_to_bytes(View(tensors), {_KEY: json.dumps(head, separators=(",", ":"))})
    Path(path).write_bytes(raw)
    return len(raw)


def _need(ok: bool, what: str, **ctx: Any) -> None:
    if not ok:
        raise PatchDecodeError(f"invalid decoded patch: {what}", **ctx)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 48)


def _array(view: View, key: str, kind_dtype: str, n: int, name: str) -> np.ndarray:
    _need(key in view, "missing array", tensor=name, array=key)
    t = view[key]
    _need(
        t.dtype == kind_dtype and t.shape == (n,),
        "array dtype or length",
        tensor=name,
        array=key,
        dtype=t.dtype,
        shape=t.shape,
    )
    return np.array(t.data)  # own the words: the file is removed after the call


def _entry(view: View, i: int, e: Any) -> TensorPatch:
    _need(isinstance(e, dict), "tensor entry", index=i)
    name, op, kind_name = e.get("name"), e.get("op"), e.get("kind")
    _need(isinstance(name, str) and 0 < len(name.encode()) <= 1024, "name", index=i)
    _need(op in ("delta", "full") and kind_name in KINDS, "op or kind", tensor=name)
    kind = get_kind(kind_name)
    _need(not kind.packed, "packed kinds are not served by vLLM here", tensor=name)
    shape, n = e.get("shape"), e.get("changed")
    _need(
        isinstance(shape, list) and len(shape) <= 16 and all(_int(d) for d in shape) and _int(n),
        "shape or count",
        tensor=name,
    )
    _need(
        all(isinstance(e.get(k), str) and _HEX.match(e[k]) for k in ("base", "target")),
        "digests",
        tensor=name,
    )
    if op == "full":
        _need(n == int(np.prod(shape, dtype=np.int64)), "full count", tensor=name)
        words = _array(view, f"t{i}.full", kind.dtype, n, name)
        full = FullOp(Tensor(kind, tuple(shape), words))
        return TensorPatch(name, kind, tuple(shape), e["base"], e["target"], full)
    pos = _array(view, f"t{i}.pos", "I64", n, name).view(np.int64)
    old = _array(view, f"t{i}.old", kind.dtype, n, name)
    new = _array(view, f"t{i}.new", kind.dtype, n, name)
    return TensorPatch(name, kind, tuple(shape), e["base"], e["target"], DeltaOp(pos, old, new))


def read_decoded(path: str | Path) -> Patch:
    """Parse and validate a decoded-patch file (module docstring); raises PatchDecodeError."""
    try:
        view = load_view(path, mmap=True)
    except (OSError, ViewError) as err:
        raise PatchDecodeError(f"cannot read the decoded patch: {err}", path=str(path)) from None
    try:
        head = json.loads(view.metadata.get(_KEY, "null"))
    except json.JSONDecodeError:
        head = None
    _need(
        isinstance(head, dict) and head.get("format") == _KEY and head.get("version") == 1, "header"
    )
    assert isinstance(head, dict)
    _need(
        all(isinstance(head.get(k), str) and _HEX.match(head[k]) for k in ("base", "target")),
        "root digests",
    )
    meta, entries = head.get("meta", {}), head.get("tensors")
    _need(isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()), "meta")
    _need(isinstance(entries, list) and len(entries) <= MAX_TENSORS, "tensor list")
    assert isinstance(entries, list)
    tensors: dict[str, TensorPatch] = {}
    for i, e in enumerate(entries):
        tp = _entry(view, i, e)
        _need(tp.name not in tensors, "duplicate name", tensor=tp.name)
        tensors[tp.name] = tp
    expected = len(entries) + 2 * sum(isinstance(tp.change, DeltaOp) for tp in tensors.values())
    _need(len(view) == expected, "unexpected arrays", arrays=len(view), expected=expected)
    return Patch(head["base"], head["target"], tensors, meta)
