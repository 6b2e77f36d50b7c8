"""A multi-version catch-up decoded inside the worker, one tensor at a time, in place.

Step *k* of a chain must be decoded against the words after steps 1..k-1. Decoding each step
against an :class:`~rollpatch.patch.overlay.Overlay` makes, for every step, a fresh copy of
every touched tensor with the composed changes scattered in: at 1–3% density every tensor is
touched, so a catch-up of *n* steps copied the model *n − 1* times. Here each touched tensor
is copied once, and every step is decoded straight into that private copy by the native
decoder (``decode_into``: it reads the base words and writes the new ones in the same pass),
so step *k* sees exactly the words after step *k − 1*; the steps' change lists are then
composed (:func:`rollpatch.patch.compose`, O(changes)). Memory: one tensor copy at a time
plus the change lists; the live weights are only read.

Only ``delta`` entries of the ``rp.ctxgolomb.v2`` codec take this path (the format every
publisher writes by default); :func:`decode_in_place` returns None for any other chain and
the caller uses the overlay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from ...errors import BaseMismatchError, ManifestError, PatchDecodeError, RollpatchError
from ...kinds import KINDS
from ...patch import Patch, TensorPatch, compose, inspect
from ...patch.codec_v2 import CtxGolombV2
from ...patch.header import DIGESTS
from ...view import Tensor, WordSource

__all__ = ["decode_in_place"]

_V2 = CtxGolombV2()


@dataclass(frozen=True)
class _Entry:
    step: int
    name: str
    kind: str
    shape: tuple[int, ...]
    base: str | None
    target: str | None
    payload: memoryview
    changed: int


def _entries(steps: list[dict[str, Any]], blobs: list[list[bytes]]) -> list[_Entry] | None:
    out: list[_Entry] = []
    for k, (step, parts) in enumerate(zip(steps, blobs, strict=True)):
        seen: set[str] = set()
        for blob in parts:
            header = inspect(blob)
            if len(parts) == 1 and (header.base, header.target) != (step["base"], step["target"]):
                raise ManifestError("patch object binds other digests than its step")
            mv = memoryview(blob)
            for e in header.tensors:
                if e["op"] != "delta" or e["codec"] != _V2.codec_id:
                    return None
                if e["name"] in seen:
                    raise ManifestError("patch shards overlap")
                seen.add(e["name"])
                start = header.payload_start + e["offset"]
                payload = mv[start : start + e["length"]]
                if blake3.blake3(payload).hexdigest() != e["b3"]:
                    raise PatchDecodeError("payload checksum mismatch", tensor=e["name"])
                out.append(
                    _Entry(
                        k,
                        e["name"],
                        e["kind"],
                        tuple(e["shape"]),
                        e["base"],
                        e["target"],
                        payload,
                        e["changed"],
                    )
                )
    return out


def decode_in_place(
    words: WordSource, steps: list[dict[str, Any]], blobs: list[list[bytes]]
) -> Patch | None:
    """The chain ``steps`` (each: ``base``, ``target``; ``blobs[k]``: its patch objects)
    decoded against ``words`` and composed into one patch; None when a tensor's entry is not
    an ``rp.ctxgolomb.v2`` delta or the native core is missing (use the overlay then)."""
    from ... import native

    if native.core is None or len(steps) < 2:
        return None
    entries = _entries(steps, blobs)
    if entries is None:
        return None
    by_name: dict[str, list[_Entry]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e)
    per_step: list[dict[str, TensorPatch]] = [{} for _ in steps]
    for name in sorted(by_name):
        if name not in words:
            raise BaseMismatchError("the engine lacks a tensor the patch changes", tensor=name)
        live = words[name]
        work = Tensor(live.kind, live.shape, np.array(live.data, copy=True))
        for e in by_name[name]:  # in step order
            if KINDS[e.kind] != live.kind or e.shape != live.shape:
                raise BaseMismatchError(
                    "base tensor layout differs from the patch", tensor=name, step=e.step
                )
            try:
                pos, old, new, _ = _V2.decode_into(e.payload, work, e.changed)
            except RollpatchError as err:
                err.context.setdefault("tensor", name)
                err.context.setdefault("step", e.step)
                raise
            per_step[e.step][name] = TensorPatch(
                name, "delta", live.kind, live.shape, e.base, e.target, pos, old, new
            )
        del work
    patch: Patch | None = None
    for step, tensors in zip(steps, per_step, strict=True):
        one = Patch(str(step["base"]), str(step["target"]), tensors, digest=DIGESTS[2])
        patch = one if patch is None else compose(patch, one)
    return patch
