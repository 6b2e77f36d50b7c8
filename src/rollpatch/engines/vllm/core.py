"""vLLM's engine-core side: a staged commit as one engine-core call, between two forward passes.

Start vLLM with ``--scheduler-cls rollpatch.engines.vllm.core.Scheduler`` (what
:mod:`.launch` does). vLLM resolves that name inside its EngineCore process; resolving it
installs one wrapper around ``EngineCore.collective_rpc`` (and, with ``ROLLPATCH_VLLM_POLL_MS``
set, the engine core's polling shm reader: :mod:`.spin`) and hands back vLLM's own scheduler
with one addition for ``keep`` commits (:func:`_scheduler`). The wrapper answers the method
:data:`ATOMIC` (``args``: the staging token, the version tag, the expected root digest, and
``kv``) and passes every other call through:

1. the workers run ``rollpatch_commit(token)``: one scatter per runtime parameter, the
   touched modules' derived buffers, the read-back (:mod:`.weights`);
2. when every rank verified and reports the expected root, the engine's ``weight_version``
   becomes the tag;
3. what the KV computed with the old weights becomes (``kv``, :data:`KvOnCommit`):
   ``recompute`` (default): the prefix cache is reset with running requests preempted (vLLM's
   own ``reset_prefix_cache(reset_running_requests=True)``, what ``/pause`` does): no KV
   computed with the old weights is used again; in-flight requests keep their tokens and
   recompute their KV with the new weights. ``keep`` (:func:`_keep_running`): requests in
   flight keep their KV and go on with the new weights over it (the built-in engine's
   semantics; their labels span both versions), and no request admitted after the commit
   can reach a block computed before it: every cached block's hash is dropped, block hashes
   chain from a new root from now on, and a request hashed from an older root is hashed
   again from the new one when the scheduler looks up its prefix (:func:`_rehash_on_lookup`:
   outside the hold, so a commit's hold does not grow with the waiting queue).

EngineCore runs utility calls in its busy loop between engine steps, and the CPU backend
never overlaps a step with it (no async scheduling, one batch in flight), so generation is
held for exactly this call: no ``/pause``, ``/resume``, ``/reset_prefix_cache`` or
``/update_weight_version`` round trip is needed around it. Each worker result gains
``core_ms`` (the hold, measured in the core) and ``reset`` (the cache reset succeeded).
``rollpatch_info`` results gain ``atomic_commit: true``, which is how the adapter learns that
the hook is installed (docs/vllm.md). The method :data:`SCHEDULER` is answered by the wrapper
alone, with no worker call: :func:`_scheduler_state`.
"""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Any, Literal

__all__ = ["ATOMIC", "KV_ON_COMMIT", "SCHEDULER", "KvOnCommit", "install"]

#: The collective_rpc method name the engine-core wrapper answers itself.
ATOMIC = "rollpatch_commit_atomic"
#: The collective_rpc method the wrapper answers with the scheduler's counts (no worker call).
SCHEDULER = "rollpatch_scheduler"
#: What a staged commit does to the KV of the requests in flight (module docstring, step 3).
KvOnCommit = Literal["recompute", "keep"]
KV_ON_COMMIT: tuple[KvOnCommit, ...] = ("recompute", "keep")


#: Bumped at every ``keep`` commit (after the new root is set): the root epoch a request's
#: block hashes started from is kept on it (``_rollpatch_epoch``, by :func:`_tag_requests`).
_EPOCH = [0]
#: Requests hashed again at their prefix lookup (:func:`_rehash_if_stale`), since start.
_REHASHED = [0]


def _keep_running(core: Any, tag: str) -> None:
    """``keep``: running requests keep their blocks; nothing admitted later reaches a block
    computed before now."""
    if getattr(core, "request_block_hasher", None) is None:
        return  # no prefix caching: no block is ever found by its hash
    from vllm.v1.core import kv_cache_utils as kcu

    # a new root: every block hashed from now on chains from it, so it equals no earlier hash
    # (vLLM reads the module's NONE_HASH at each first block of a request); then the epoch,
    # so a request tagged with the new one was hashed from the new root
    kcu.NONE_HASH = kcu.BlockHash(
        hashlib.sha256(bytes(kcu.NONE_HASH) + b"rollpatch:" + tag.encode()).digest()
    )
    _EPOCH[0] += 1
    # every block's hash dropped (vLLM's own reset, less its refusal while blocks are in use:
    # blocks held by running requests stay theirs, only unreachable by a prefix lookup)
    kvm = core.scheduler.kv_cache_manager
    for pool in dict.fromkeys(m.block_pool for m in kvm.coordinator.single_type_managers):
        pool.get_num_free_blocks = lambda pool=pool: pool.num_gpu_blocks - 1
        try:
            pool.reset_prefix_cache()
        finally:
            del pool.get_num_free_blocks
    if getattr(kvm, "prefix_cache_stats", None) is not None:
        kvm.prefix_cache_stats.reset = True  # as KVCacheManager.reset_prefix_cache says it
    # requests still waiting were hashed from the old root: each is hashed again when the
    # scheduler looks up its prefix (_rehash_on_lookup), not here: a queue of 800 prompts of
    # 448 tokens added 18 ms to this hold (bench/vllm_queue.py)


def _rehash_if_stale(req: Any) -> None:
    """A request hashed from a root older than the last ``keep`` commit's, with nothing
    computed: hashed again from the new root. That is a request waiting across the commit,
    one hashed in EngineCore's input thread before it and added after, or one that ran across
    it and was preempted later (vLLM sets its computed tokens back to 0). A request with KV
    computed keeps its hashes: its blocks are its own, and chain from blocks no lookup finds
    any more. A request with no tag (the constructor hook missing) is hashed again once."""
    if getattr(req, "_rollpatch_epoch", -1) != _EPOCH[0] and req.num_computed_tokens == 0:
        req._rollpatch_epoch = _EPOCH[0]
        req.block_hashes.clear()
        req.update_block_hashes()
        _REHASHED[0] += 1


def _rehash_on_lookup(kvm: Any) -> None:
    """Wrap ``kvm.get_computed_blocks`` (vLLM's ``KVCacheManager``; every prefix lookup of a
    request being scheduled goes through it) so that a stale request (:func:`_rehash_if_stale`)
    is hashed again first. vLLM reads a waiting request's block hashes nowhere before that
    lookup, and caches its blocks under them only after it. A KV connector reads them on
    other paths too (``get_computed_blocks_for_connector``, remote KV loads), but with a
    connector keep mode recomputes instead (:func:`_kv_connected`): the epoch never moves."""
    lookup = kvm.get_computed_blocks

    def get_computed_blocks(request: Any) -> Any:
        _rehash_if_stale(request)
        return lookup(request)

    kvm.get_computed_blocks = get_computed_blocks


def _tag_requests() -> None:
    """Each request records the root epoch its block hashes start from, as it is made (its
    first hashes are computed in its constructor; once per request, not per token)."""
    from vllm.v1.request import Request

    original = Request.__init__
    if getattr(original, "_rollpatch", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # read before vLLM's constructor hashes: a commit between the two leaves the tag
        # older than the root, which costs one needless re-hash, never a missed one
        self._rollpatch_epoch = _EPOCH[0]
        original(self, *args, **kwargs)

    __init__._rollpatch = True  # type: ignore[attr-defined]
    Request.__init__ = __init__


def _commit_atomic(
    core: Any,
    timeout: float | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    t0 = time.perf_counter()
    token, tag, root = (str(a) for a in args[:3])
    kv = str(args[3]) if len(args) > 3 else "recompute"
    if kv not in KV_ON_COMMIT:
        raise ValueError(f"unknown kv_on_commit {kv!r}")
    reset = False
    running = _scheduler_state(core)["running"]  # requests whose KV the mode applies to
    try:
        # kwargs: the adapter's owner token (:mod:`rollpatch.engines.ownership`), checked there
        results = core.model_executor.collective_rpc("rollpatch_commit", timeout, (token,), kwargs)
        if all(isinstance(r, dict) and r.get("ok") and r.get("root") == root for r in results):
            core.set_weight_version(tag)
        elif len(results) > 1:
            results = _undo_ranks(core, timeout, token, results, kwargs)
    finally:  # whatever the workers did, no KV of the weights before it is used again
        if kv == "keep" and _kv_connected(core):
            kv = "recompute"  # keep resets no connector's cache: what recompute's reset does
        if kv == "keep":
            _keep_running(core, tag)
            reset = True  # the cache can no longer serve old-weight KV
        else:
            reset = bool(core.reset_prefix_cache(reset_running_requests=True))
    ms = round((time.perf_counter() - t0) * 1e3, 3)
    out = {"core_ms": ms, "reset": reset, "kv": kv, "running": running}
    return [dict(r, **out) if isinstance(r, dict) else r for r in results]


def _undo_ranks(
    core: Any,
    timeout: float | None,
    token: str,
    results: list[Any],
    kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """TP > 1, a commit not verified on every rank (one failed its check after the others
    wrote, or the ranks reached other digests): every rank that wrote puts its old words back
    (``rollpatch_undo``), inside the same hold, so no token is generated over words of two
    versions. The failed ranks' errors name their rank and the ranks undone; a rank whose undo
    failed stays on the new words (the adapter then finds the ranks disagree: not ready)."""
    undo = core.model_executor.collective_rpc("rollpatch_undo", timeout, (token,), kwargs)
    undone = [i for i, u in enumerate(undo) if isinstance(u, dict) and u.get("undone")]
    stuck = [i for i, u in enumerate(undo) if not (isinstance(u, dict) and u.get("ok"))]
    out = []
    for i, r in enumerate(results):
        if isinstance(r, dict) and not r.get("ok") and isinstance(r.get("error"), dict):
            ctx = dict(r["error"].get("context") or {}, rank=i, undone_ranks=str(undone))
            if stuck:
                ctx["undo_failed_ranks"] = str(stuck)
            r = dict(r, error=dict(r["error"], context=ctx))
        out.append(r)
    return out


def _kv_connected(core: Any) -> bool:
    """A KV connector (offloading, transfer) or an aux-output connector holds KV outside the
    block pool, which keep mode does not reach."""
    sched = getattr(core, "scheduler", None)
    return any(getattr(sched, a, None) is not None for a in ("connector", "aux_output_connector"))


def _scheduler_state(core: Any) -> dict[str, int]:
    """The engine core's requests now (running, waiting: the scheduler's own counts, exact
    where vLLM's ``/metrics`` gauges lag or, while paused, stand still) and the requests
    hashed again at their lookup after a ``keep`` commit since start (``rehashed``)."""
    counts = getattr(getattr(core, "scheduler", None), "get_request_counts", None)
    running, waiting = counts() if callable(counts) else (-1, -1)
    return {"running": running, "waiting": waiting, "rehashed": _REHASHED[0]}


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
            return _commit_atomic(self, timeout, tuple(args), kwargs)
        if method == SCHEDULER:
            return [_scheduler_state(self)]
        out = original(self, method, timeout, args, kwargs)
        if method == "rollpatch_info" and isinstance(out, list):
            out = [dict(r, atomic_commit=True) if isinstance(r, dict) else r for r in out]
        return out

    collective_rpc._rollpatch = True  # type: ignore[attr-defined]
    EngineCore.collective_rpc = collective_rpc


def __getattr__(name: str) -> Any:
    """``Scheduler``: install the wrapper (and :mod:`.spin`), then vLLM's scheduler class with
    one addition (:func:`_scheduler`)."""
    if name != "Scheduler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    install()
    _tag_requests()
    from .spin import install as poll_instead_of_spin

    poll_instead_of_spin()
    return _scheduler()


@functools.cache
def _scheduler() -> Any:
    """vLLM's scheduler, with one addition: a request hashed from a root older than the last
    ``keep`` commit's is hashed again before its prefix is looked up (:func:`_rehash_on_lookup`)."""
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    class Scheduler(VllmScheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _rehash_on_lookup(self.kv_cache_manager)

    return Scheduler
