"""Staging at TP 1: one control thread inside SGLang decodes and proves the update, and the
adapter checks that what it staged is the patch's (the TP > 1 counterpart is :mod:`.tp`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import TargetMismatchError
from ..staged import StagedUpdate, WriteMode
from .channel import SglangChannel

__all__ = ["stage_one"]


def stage_one(
    channel: SglangChannel,
    op: str,
    args: dict[str, Any],
    *,
    targets: Mapping[str, str | None],
    base: str,
    target: str,
    mode: WriteMode,
) -> tuple[StagedUpdate, Mapping[str, Any]]:
    """``op`` on the control thread with ``args`` (``stage_decoded``: the decoded patch's
    ``paths``, ``base`` and ``target``; ``stage_encoded``: the ``steps``), checked to stage
    ``base`` -> ``target`` with the ``targets`` digests (dropped inside SGLang and refused
    otherwise). Returns the staged update and the control thread's answer (its timings)."""
    r = channel.control(op, **args, mode=mode)
    if (
        r["base"] != base
        or r["target"] != target
        or any(r["digests"].get(n) != d for n, d in targets.items())
    ):
        channel.control("drop")
        raise TargetMismatchError("the staged update is not the patch's", engine="sglang")
    staged = StagedUpdate(
        base,
        target,
        {},
        dict(r["digests"]),
        {
            "sglang_token": r["token"],
            "changed": int(r["changed"]),
            "nbytes": int(r["nbytes"]),
            "buffers": int(r.get("buffers", 0)),
        },
    )
    return staged, r
