"""vLLM's engine-core side: a staged commit as one engine-core call, between two forward passes.

Start vLLM with ``--scheduler-cls rollpatch.engines.vllm.core.Scheduler`` (what
:mod:`.launch` does). vLLM resolves that name inside its EngineCore process; resolving it
installs one wrapper around ``EngineCore.collective_rpc`` (and, with ``ROLLPATCH_VLLM_POLL_MS``
set, the engine core's polling shm reader: :mod:`.spin`) and hands back vLLM's own scheduler,
unchanged. The wrapper answers the method :data:`ATOMIC` (``args``: the staging token, the
version tag, the expected root digest) and passes every other call through:

1. the workers run ``rollpatch_commit(token)``: one scatter per runtime parameter, the
   touched modules' derived buffers, the read-back (:mod:`.weights`);
2. when every rank verified and reports the expected root, the engine's ``weight_version``
   becomes the tag;
3. the prefix cache is reset with running requests preempted (vLLM's own
   ``reset_prefix_cache(reset_running_requests=True)``, what ``/pause`` does): no KV computed
   with the old weights is used again; in-flight requests keep their tokens and recompute
   their KV with the new weights.

EngineCore runs utility calls in its busy loop between engine steps, and the CPU backend
never overlaps a step with it (no async scheduling, one batch in flight), so generation is
held for exactly this call: no ``/pause``, ``/resume``, ``/reset_prefix_cache`` or
``/update_weight_version`` round trip is needed around it. Each worker result gains
``core_ms`` (the hold, measured in the core) and ``reset`` (the cache reset succeeded).
``rollpatch_info`` results gain ``atomic_commit: true``, which is how the adapter learns that
the hook is installed (docs/vllm.md).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["ATOMIC", "install"]

#: The collective_rpc method name the engine-core wrapper answers itself.
ATOMIC = "rollpatch_commit_atomic"


def _commit_atomic(core: Any, timeout: float | None, args: tuple[Any, ...]) -> list[Any]:
    t0 = time.perf_counter()
    token, tag, root = (str(a) for a in args)
    reset = False
    try:
        results = core.model_executor.collective_rpc("rollpatch_commit", timeout, (token,), None)
        if all(isinstance(r, dict) and r.get("ok") and r.get("root") == root for r in results):
            core.set_weight_version(tag)
    finally:  # whatever the workers did, no KV of the weights before it is used again
        reset = bool(core.reset_prefix_cache(reset_running_requests=True))
    ms = round((time.perf_counter() - t0) * 1e3, 3)
    return [dict(r, core_ms=ms, reset=reset) if isinstance(r, dict) else r for r in results]


def install() -> None:
    """Wrap ``EngineCore.collective_rpc`` (once per process)."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.collective_rpc
    if getattr(original, "_rollpatch", False):
        return

    def collective_rpc(
        self: Any,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if method == ATOMIC:
            return _commit_atomic(self, timeout, tuple(args))
        out = original(self, method, timeout, args, kwargs)
        if method == "rollpatch_info" and isinstance(out, list):
            out = [dict(r, atomic_commit=True) if isinstance(r, dict) else r for r in out]
        return out

    collective_rpc._rollpatch = True  # type: ignore[attr-defined]
    EngineCore.collective_rpc = collective_rpc


def __getattr__(name: str) -> Any:
    """``Scheduler``: install the wrapper (and :mod:`.spin`), then vLLM's own scheduler class."""
    if name != "Scheduler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    install()
    from .spin import install as poll_instead_of_spin

    poll_instead_of_spin()
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler
