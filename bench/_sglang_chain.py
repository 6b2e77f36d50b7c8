"""bench/sglang.py's catch-up phase: a replica several versions behind, the chain decoded
inside SGLang against what the follower did before SGLang took chains."""

from __future__ import annotations

import time
from typing import Any

from _vllm_server import BenchError
from _vllm_world import World


def view_of(world: World, v: int) -> Any:
    """Version ``v``'s view, read from its checkpoint."""
    from rollpatch.io.safetensors import load_view

    return load_view(world.checkpoint(v) / "model.safetensors")


def phase_chain(world: World, engine: Any, n: int, reps: int) -> dict[str, list[dict[str, float]]]:
    """The catch-up of a replica ``n`` behind, from v0 to v``n``, the ways alternated
    ``reps`` times, each from a fresh load of v0: ``inside`` — the ``n`` step patches
    in one ``stage_encoded``, decoded inside SGLang step after step; ``folded`` (``n >= 2``
    with ``world.fold_every``: v0 is the anchor) — the one folded patch v0 → v``n`` the
    run published, in one ``stage_encoded``, what the follower's plan takes; ``follower`` —
    what the follower did before SGLang took chains: each step decoded here against the
    engine's words (exported from SGLang tensor by tensor through files) under an overlay of
    the steps before it, composed, and staged as one decoded patch (``stage``)."""
    from rollpatch.engines.staged import EncodedStep
    from rollpatch.patch import compose, decode
    from rollpatch.patch.overlay import Overlay

    def inside() -> Any:
        steps = [
            EncodedStep((world.patch_blob(v),), world.digests[v - 1], world.digests[v])
            for v in range(1, n + 1)
        ]
        staged = engine.stage_encoded(steps, n)
        if staged is None:
            raise BenchError("SGLang did not take the chain (stage_encoded gave None)")
        return staged

    def folded() -> Any:
        step = EncodedStep((world.patch_blob(n, base=0),), world.digests[0], world.digests[n])
        staged = engine.stage_encoded([step], n)
        if staged is None:
            raise BenchError("SGLang did not take the folded patch (stage_encoded gave None)")
        return staged

    def follower() -> Any:
        words = engine.words()
        patch = decode(world.patch_blob(1), words, check_base=False)
        for v in range(2, n + 1):
            patch = compose(
                patch, decode(world.patch_blob(v), Overlay(words, patch), check_base=False)
            )
        return engine.stage(patch, n)

    ways = [("inside", inside), ("follower", follower)]
    if n >= 2 and world.fold_every:
        ways.insert(1, ("folded", folded))
    out: dict[str, list[dict[str, float]]] = {name: [] for name, _ in ways}
    for r in range(reps):
        for name, fn in ways[r % len(ways) :] + ways[: r % len(ways)]:
            engine.load(view_of(world, 0), 0)
            t0 = time.perf_counter()
            staged = fn()
            t1 = time.perf_counter()
            engine.pause()
            try:
                engine.commit_staged(staged, n)
            finally:
                engine.resume()
            serving = engine.channel._frozen_at + engine.channel.held_s
            if engine.digest != world.digests[n] or engine.held()[1] != world.digests[n]:
                raise BenchError(f"{name} chain to v{n}: the engine does not hold the digest")
            out[name].append(
                {
                    **{f"{k}_ms": float(x) for k, x in engine.last_stage_ms.items()},
                    "stage_s": t1 - t0,
                    "pause_s": engine.channel.held_s,
                    "visible_s": serving - t0,
                }
            )
    return out
