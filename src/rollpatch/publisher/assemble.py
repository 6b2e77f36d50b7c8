"""The version's manifest from every rank's shard message: the patch bases all shards provide,
keyframes when all wrote one, sliced tensors' whole digests from their parts (rank 0)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..errors import BoardError
from ..manifest import KeyframeObject, Manifest, PatchObject, SlicedTensor
from ..types import ObjectRef
from ..view import root_digest
from .config import PublisherConfig
from .sharded_slices import combine

__all__ = ["assemble_manifest"]


def assemble_manifest(
    *,
    run: str,
    version: int,
    parent: int | None,
    keyframe: bool,
    messages: list[dict[str, Any]],
    root_digests: Mapping[int, str],
    config: PublisherConfig,
    meta: Mapping[str, str],
    layout: Mapping[str, tuple[object, ...]] | None = None,
) -> Manifest:
    """The manifest of ``version`` from every rank's message (rank 0 calls this).

    Patch bases every shard provided are listed (a base some shard lacks is left out: its
    objects stay unreferenced); keyframes only if every shard wrote one. Sliced tensors get
    their whole digest from the ranks' parts; ``layout`` (the parent's sliced layouts, None:
    unknown) must not change within a run, since every patch is cut by it.
    """
    digests: dict[str, str] = {}
    parts: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for rank, msg in enumerate(messages):
        for name, part in msg.get("slices", {}).items():
            parts.setdefault(name, []).append((rank, part))
    sliced = tuple(combine(name, parts[name]) for name in sorted(parts))
    for rank, msg in enumerate(messages):
        for name, d in msg["digests"].items():
            if name in digests or name in parts:
                raise BoardError(
                    "two ranks publish the same tensor: shards must be disjoint",
                    tensor=name,
                    rank=rank,
                    version=version,
                )
            digests[name] = d
    digests.update({t.name: t.digest for t in sliced})
    _check_layout(sliced, layout, version)
    for msg in messages:  # a sharded rank resumed on the whole view: every name has a rank
        lost = sorted(set(msg.get("resumed") or ()) - digests.keys())
        if lost:
            raise BoardError(
                "a tensor of the resumed version is in no rank's shard: a sharded publisher "
                "cannot drop or rename tensors across a restart; nothing published",
                version=version,
                tensor=lost[0],
                n=len(lost),
                hint="publish the same tensors, or start a new run (or an unsharded "
                "publisher, which drops them) for the new set",
            )
    bases = set.intersection(*({p["base"] for p in m["patches"]} for m in messages))
    patches = []
    for base in sorted(bases):
        if base not in root_digests:
            continue
        for shard, msg in enumerate(messages):
            p = next(p for p in msg["patches"] if p["base"] == base)
            patches.append(PatchObject(_ref(p), base, root_digests[base], shard))
    keyframes: list[KeyframeObject] = []
    if keyframe and all(m["keyframe"] is not None for m in messages):
        keyframes = [KeyframeObject(_ref(m["keyframe"]), s) for s, m in enumerate(messages)]
    if len(messages) == 1:  # unsharded: the object must bind exactly the manifest's roots
        _check_binds(messages[0]["patches"], root_digests, root_digest(digests), version)
    if parent is not None and parent not in bases:
        raise BoardError(
            "a shard has no step patch from the parent", version=version, parent=parent
        )
    if not patches and not keyframes:
        raise BoardError("a version needs a patch or a keyframe on every shard", version=version)
    m = Manifest(
        run=run,
        version=version,
        parent=parent,
        format=config.format,
        target=root_digest(digests),
        view_bytes=sum(int(msg["nbytes"]) for msg in messages),
        created=time.time(),
        publisher=config.publisher_id,
        patches=tuple(patches),
        keyframes=tuple(keyframes),
        shards=len(messages),
        meta=dict(meta),
        sliced=sliced,
    )
    return m


def _check_layout(
    sliced: tuple[SlicedTensor, ...], layout: Mapping[str, tuple[object, ...]] | None, version: int
) -> None:
    if layout is None:
        return
    now = {t.name: t.layout() for t in sliced}
    if now != dict(layout):
        changed = sorted(k for k in now.keys() | layout.keys() if now.get(k) != layout.get(k))
        raise BoardError(
            "the slicing of a tensor changed within the run: patches are cut by it",
            version=version,
            tensor=changed[0],
            hint="keep the ranks' slices fixed (same world size and sharding), or publish "
            "under a new run",
        )


def _check_binds(
    patches: list[dict[str, Any]], roots: Mapping[int, str], target: str, version: int
) -> None:
    """Every patch object of an unsharded version binds its base version's root and the new
    root, as followers require (``replay``): a publisher that wrote another is refused here,
    before the manifest and LATEST name a version nobody can rebuild."""
    for p in patches:
        base, binds = int(p["base"]), p.get("binds")
        if base in roots and binds is not None and tuple(binds) != (roots[base], target):
            raise BoardError(
                "the patch object does not bind the version's root digests (internal error): "
                "nothing published",
                version=version,
                base=base,
                hint="report it; publish under a new run meanwhile",
            )


def _ref(d: Mapping[str, Any]) -> ObjectRef:
    return ObjectRef(str(d["key"]), int(d["size"]), str(d["b3"]))
