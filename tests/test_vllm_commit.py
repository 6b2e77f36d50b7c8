"""vLLM's staged commit as one engine-core call (offline: no vLLM needed).

- the engine-core hook (:mod:`rollpatch.engines.vllm.core`) against a stand-in EngineCore:
  the workers' commit, the version tag only when every rank verified, the prefix cache reset
  with running requests preempted on every way out; with ``kv_on_commit="keep"``, running
  requests kept and every block computed before the commit out of reach of later ones;
- the adapter with that hook: a commit is one ``/collective_rpc`` call, the commit gate does
  not pause around it, and a wrong result leaves the engine not ready;
- the worker's writes under the pause (real torch parameters, the CPU path): old words
  checked as they are overwritten, slice by slice, on two threads, all or nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollpatch.engines.staged import StagedUpdate
from rollpatch.engines.vllm import VllmEngine
from rollpatch.engines.vllm.core import ATOMIC, _commit_atomic
from rollpatch.errors import BaseMismatchError, TargetMismatchError
from rollpatch.follower.commit import CommitGate
from rollpatch.kinds import get_kind
from rollpatch.patch import diff
from tests import vllm_env, vllm_layouts


class _Executor:
    def __init__(self, results: list[Any] | Exception) -> None:
        self.results = results
        self.calls: list[tuple[Any, ...]] = []

    def collective_rpc(self, method: str, timeout: Any, args: tuple[Any, ...], kw: Any) -> Any:
        self.calls.append((method, args, kw) if kw else (method, args))
        if isinstance(self.results, Exception):
            raise self.results
        return self.results


class _Core:
    """What the hook uses of vLLM's EngineCore."""

    def __init__(self, results: list[Any] | Exception, reset_ok: bool = True) -> None:
        self.model_executor = _Executor(results)
        self.version = "0"
        self.resets: list[bool] = []
        self.reset_ok = reset_ok

    def set_weight_version(self, v: str) -> None:
        self.version = v

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.resets.append(reset_running_requests)
        return self.reset_ok


def test_engine_core_commits_tags_and_resets_in_one_call() -> None:
    ok = [{"ok": True, "root": "r1", "digests": {}}] * 2
    core = _Core(ok)
    out = _commit_atomic(core, 5.0, ("tok", "7", "r1"), {"owner": "a"})
    # the adapter's owner token reaches the workers' commit (engines/ownership.py)
    assert core.model_executor.calls == [("rollpatch_commit", ("tok",), {"owner": "a"})]
    assert core.version == "7" and core.resets == [True]  # running requests preempted
    assert all(r["reset"] is True and r["core_ms"] >= 0 for r in out)
    assert all(r["running"] == -1 for r in out)  # this stand-in has no scheduler to count
    # one rank disagrees on the root: no tag, but the cache is still reset
    core = _Core([ok[0], {"ok": True, "root": "other"}])
    _commit_atomic(core, 5.0, ("tok", "8", "r1"))
    assert core.version == "0" and core.resets == [True]
    core = _Core([{"ok": False, "error": {"type": "TargetMismatchError"}}], reset_ok=False)
    out = _commit_atomic(core, 5.0, ("tok", "8", "r1"))
    assert core.version == "0" and out[0]["reset"] is False
    core = _Core(RuntimeError("worker died"))
    with pytest.raises(RuntimeError):
        _commit_atomic(core, 5.0, ("tok", "8", "r1"))
    assert core.version == "0" and core.resets == [True]


class _Pool:
    """vLLM's BlockPool as the keep path uses it: refuses a reset while blocks are in use."""

    def __init__(self) -> None:
        self.num_gpu_blocks, self.hashes = 10, {b"h1": 1, b"h2": 2}

    def get_num_free_blocks(self) -> int:
        return 3  # 6 blocks held by running requests

    def reset_prefix_cache(self) -> bool:
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            return False
        self.hashes.clear()
        return True


class _Request:
    def __init__(self, computed: int, kcu: Any) -> None:
        self.num_computed_tokens, self.kcu = computed, kcu
        self.block_hashes = [b"old"]

    def update_block_hashes(self) -> None:
        self.block_hashes.append(b"from:" + self.kcu.NONE_HASH)


def test_keep_mode_keeps_running_requests_and_cuts_off_old_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys
    import types

    kcu = types.ModuleType("vllm.v1.core.kv_cache_utils")
    kcu.NONE_HASH, kcu.BlockHash = b"root0", bytes  # type: ignore[attr-defined]
    pkg = types.ModuleType("vllm.v1.core")
    pkg.kv_cache_utils = kcu  # type: ignore[attr-defined]
    for name, mod in (("vllm", types.ModuleType("vllm")), ("vllm.v1", types.ModuleType("vllm.v1"))):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(sys.modules, "vllm.v1.core", pkg)
    monkeypatch.setitem(sys.modules, "vllm.v1.core.kv_cache_utils", kcu)
    pool = _Pool()
    from rollpatch.engines.vllm import core as hook

    monkeypatch.setattr(hook, "_EPOCH", [0])
    monkeypatch.setattr(hook, "_REHASHED", [0])
    waiting, started = _Request(0, kcu), _Request(5, kcu)
    for r in (waiting, started):
        r._rollpatch_epoch = 0  # type: ignore[attr-defined]  # as made
    core = _Core([{"ok": True, "root": "r1"}])
    core.request_block_hasher = object()  # type: ignore[attr-defined]  # prefix caching on
    managers = (types.SimpleNamespace(block_pool=pool), types.SimpleNamespace(block_pool=pool))
    core.scheduler = types.SimpleNamespace(  # type: ignore[attr-defined]
        kv_cache_manager=types.SimpleNamespace(
            coordinator=types.SimpleNamespace(single_type_managers=managers)
        ),
        waiting=[waiting, started],
    )
    out = _commit_atomic(core, 5.0, ("tok", "7", "r1", "keep"))
    assert core.version == "7" and core.resets == [] and out[0]["kv"] == "keep"  # none preempted
    assert out[0]["reset"] is True and pool.hashes == {}  # no block reachable by its hash
    assert pool.get_num_free_blocks() == 3  # vLLM's own accounting untouched afterwards
    root = kcu.NONE_HASH  # type: ignore[attr-defined]
    assert root != b"root0" and len(root) == 32 and hook._EPOCH == [1]
    # nothing is hashed inside the hold: the waiting request is, at its prefix lookup
    assert waiting.block_hashes == [b"old"] and started.block_hashes == [b"old"]
    kvm = types.SimpleNamespace(get_computed_blocks=lambda req: list(req.block_hashes))
    hook._rehash_on_lookup(kvm)
    assert kvm.get_computed_blocks(waiting) == [b"from:" + root]  # looked up from the new root
    assert kvm.get_computed_blocks(waiting) == [b"from:" + root]  # once: it is current now
    assert kvm.get_computed_blocks(started) == [b"old"]  # tokens computed: its blocks are its own
    _commit_atomic(core, 5.0, ("tok", "8", "r1", "keep"))
    assert kcu.NONE_HASH not in (root, b"root0")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown kv_on_commit"):
        _commit_atomic(core, 5.0, ("tok", "9", "r1", "drop"))
    assert hook._REHASHED == [1]
    # hashed (in EngineCore's input thread) before a keep commit, added after it; preempted
    # after running across it (computed tokens back to 0); no tag at all: hashed again
    late, fresh, untagged = _Request(0, kcu), _Request(0, kcu), _Request(0, kcu)
    late._rollpatch_epoch = 1  # type: ignore[attr-defined]
    fresh._rollpatch_epoch = 2  # type: ignore[attr-defined]
    started.num_computed_tokens = 0
    new = [b"from:" + kcu.NONE_HASH]  # type: ignore[attr-defined]
    assert kvm.get_computed_blocks(late) == new and kvm.get_computed_blocks(started) == new
    assert kvm.get_computed_blocks(untagged) == new
    assert kvm.get_computed_blocks(fresh) == [b"old"]
    # rollpatch_info reports the scheduler's counts and the lookups that hashed again
    core.scheduler.get_request_counts = lambda: (2, 5)  # type: ignore[attr-defined]
    assert hook._scheduler_state(core) == {"running": 2, "waiting": 5, "rehashed": 4}
    assert hook._scheduler_state(object())["waiting"] == -1  # no scheduler to ask
    # a KV connector holds KV that keep mode does not reach: recompute instead, and say so
    core.scheduler.connector = object()  # type: ignore[attr-defined]
    out = _commit_atomic(core, 5.0, ("tok", "11", "r1", "keep"))
    assert core.resets == [True] and out[0]["kv"] == "recompute"
    # no prefix caching (vLLM leaves NONE_HASH unset): nothing to cut off, the commit goes on
    del kcu.NONE_HASH  # type: ignore[attr-defined]
    core = _Core([{"ok": True, "root": "r1"}])
    out = _commit_atomic(core, 5.0, ("tok", "10", "r1", "keep"))
    assert core.version == "10" and out[0]["reset"] is True and core.resets == []


def test_the_hook_tags_requests_and_its_scheduler_wraps_the_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What vLLM loads (with stand-in vLLM modules): each request is tagged with the epoch
    before vLLM's constructor hashes it, and the scheduler's KV-cache manager looks a stale
    request up only after hashing it again."""
    import sys
    import types

    from rollpatch.engines.vllm import core as hook

    monkeypatch.setattr(hook, "_EPOCH", [3])
    monkeypatch.setattr(hook, "_REHASHED", [0])
    seen: list[int] = []

    class Request:
        def __init__(self, tokens: int) -> None:
            seen.append(self._rollpatch_epoch)  # type: ignore[attr-defined]  # tagged first
            self.num_computed_tokens, self.block_hashes = 0, [f"h{hook._EPOCH[0]}"]

        def update_block_hashes(self) -> None:
            self.block_hashes.append(f"h{hook._EPOCH[0]}")

    class Manager:
        def get_computed_blocks(self, request: Request) -> list[str]:
            return list(request.block_hashes)

    class VllmScheduler:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.kv_cache_manager = Manager()

    req_mod = types.ModuleType("vllm.v1.request")
    req_mod.Request = Request  # type: ignore[attr-defined]
    sched_mod = types.ModuleType("vllm.v1.core.sched.scheduler")
    sched_mod.Scheduler = VllmScheduler  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.request", req_mod)
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.scheduler", sched_mod)
    hook._scheduler.cache_clear()
    try:
        hook._tag_requests()
        hook._tag_requests()  # once: not wrapped twice
        sched = hook._scheduler()(object(), flag=True)
    finally:
        hook._scheduler.cache_clear()
    req = Request(8)
    assert seen == [3] and req._rollpatch_epoch == 3  # type: ignore[attr-defined]
    assert sched.kv_cache_manager.get_computed_blocks(req) == ["h3"]  # current: as it was
    hook._EPOCH[0] = 4  # a keep commit
    assert sched.kv_cache_manager.get_computed_blocks(req) == ["h4"]  # hashed again first
    assert hook._REHASHED == [1] and req._rollpatch_epoch == 4  # type: ignore[attr-defined]


def test_keep_mode_needs_the_engine_core_hook() -> None:
    from rollpatch.errors import ConfigError
    from rollpatch.sidecar.server import make_engine

    v0 = vllm_layouts.words_view(vllm_layouts.checkpoint())
    fake = vllm_env.FakeVllm(v0.digest())
    eng = VllmEngine("http://127.0.0.1:9", transport="rpc", kv_on_commit="keep")
    eng.http = fake  # type: ignore[assignment]
    eng._atomic = False  # a server started without --scheduler-cls
    with pytest.raises(ConfigError, match="engine-core hook"):
        eng.commit_staged(_staged(v0.digest(), v0.digest(), {}), 1)
    with pytest.raises(ConfigError, match="kv_on_commit"):
        VllmEngine("http://127.0.0.1:9", kv_on_commit="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="for --engine vllm"):
        make_engine("sglang", engine_url="http://127.0.0.1:9", kv_on_commit="keep")


class _AtomicVllm(vllm_env.FakeVllm):
    """A scripted server whose EngineCore runs the hook."""

    def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        if path == "/collective_rpc" and body["method"] == "rollpatch_info":
            self.calls.append(("rollpatch_info", body["args"]))
            return {"results": [{"ok": True, "tensors": {}, "atomic_commit": True}]}
        if path == "/collective_rpc" and body["method"] == ATOMIC:
            self.calls.append((ATOMIC, body["args"]))
            if self.next_root is not None:
                self.root = self.next_root
            return {"results": [dict(self.result, core_ms=1.5, reset=True)]}
        return super().post(path, body, timeout=timeout)


def _staged(base: str, target: str, digests: dict[str, str]) -> StagedUpdate:
    return StagedUpdate(base, target, {}, digests, {"token": "t0k"})


def test_adapter_commits_in_one_call_and_the_gate_does_not_pause() -> None:
    v0 = vllm_layouts.words_view(vllm_layouts.checkpoint())
    v1 = vllm_layouts.words_view(vllm_layouts.random_step(vllm_layouts.checkpoint(), 4))
    fake = _AtomicVllm(v0.digest())
    eng = VllmEngine("http://127.0.0.1:9", transport="rpc")
    eng.http = fake  # type: ignore[assignment]
    eng.adopt(0, v0.digest())
    assert eng.pauses_itself
    gate = CommitGate(eng, "pause")
    fake.script(True, v1.tensor_digests(), v1.digest())
    fake.calls.clear()
    gate.run(lambda: eng.commit_staged(_staged(v0.digest(), v1.digest(), {}), 1))
    # no /pause, /resume, /reset; the KV of requests in flight recomputed (the default)
    assert fake.calls == [(ATOMIC, ["t0k", "1", v1.digest(), "recompute"])]
    assert (eng.version, eng.digest) == (1, v1.digest())
    assert eng.last_timings["core_ms"] == 1.5 and gate.last is not None and gate.last.ok
    # the workers report another root: not the target, and the engine no longer holds v1
    fake.script(True, v0.tensor_digests(), "f" * 64)
    with pytest.raises(TargetMismatchError):
        gate.run(lambda: eng.commit_staged(_staged(v1.digest(), v0.digest(), {}), 2))
    assert (eng.version, eng.digest) == (None, None)
    assert fake.calls[-1] == ("/update_weight_version", {"new_version": "rollpatch:not-ready"})
    assert not any(c[0].startswith("/pause") for c in fake.calls)


def _weights(model: Any, *, alias: bool | None = None) -> Any:
    """The worker's core over ``model``'s parameters, each replicated whole (TP 1)."""
    from rollpatch.engines.vllm.layout import ParamSpec, Shard
    from rollpatch.engines.vllm.params import TorchParams
    from rollpatch.engines.vllm.weights import RuntimeWeights

    specs = [
        ParamSpec(n, "replicated", (Shard(n, tuple(p.shape)),)) for n, p in model.named_parameters()
    ]
    kinds = {s.param: get_kind("bf16") for s in specs}
    return RuntimeWeights(specs, kinds, TorchParams(model, 1, alias=alias).access())


def test_writes_check_old_words_slice_by_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the pause the CPU path checks each old word as it overwrites it (native core):
    a word changed behind the digests after staging fails the commit, nothing stays
    written; a clean commit writes every slice and reads it back."""
    torch = pytest.importorskip("torch")
    from rollpatch import native
    from rollpatch.engines import writing

    if native.core is None:
        pytest.fail("the native core is not built (pip install -e .)", pytrace=False)
    monkeypatch.setattr(writing, "SLICE", 3)  # many slices per parameter
    monkeypatch.setenv("ROLLPATCH_THREADS", "2")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.randn(8, 6).to(torch.bfloat16), requires_grad=False)
    model.b = torch.nn.Parameter(torch.randn(7, 5).to(torch.bfloat16).t(), requires_grad=False)
    w = _weights(model, alias=True)

    def words() -> dict[str, np.ndarray]:
        return {
            n: p.detach().view(torch.int16).numpy().view(np.uint16).copy()
            for n, p in model.named_parameters()
        }

    v0 = vllm_layouts.words_view(words())
    v1 = vllm_layouts.words_view(words())
    for n in v1:
        v1[n].data[1::2] ^= 0x0101
        v1.invalidate(n)
    staged = w.stage(diff(v0, v1))
    storage = model.b.data.view(torch.int16).t().reshape(-1)  # b's memory, in storage order
    storage[5] ^= 4  # behind every digest, at a position the patch changes (logical 1)
    with pytest.raises(BaseMismatchError):
        w.commit_staged(staged)
    # nothing of v1 stays written; the rollback writes the base's words over every staged
    # position, the one changed behind the digests included
    assert {n: a.reshape(-1).tolist() for n, a in words().items()} == {
        n: v0[n].data.tolist() for n in v0
    }
    assert w.digests(fresh=True) == v0.tensor_digests()
    w.commit_staged(w.stage(diff(v0, v1)))
    assert {n: a.reshape(-1).tolist() for n, a in words().items()} == {
        n: v1[n].data.tolist() for n in v1
    }
    assert w.last_phases["threads"] == 2.0 and w.last_phases["write_ms"] > 0


def _packed_model(torch: Any) -> Any:
    """Two linear-like modules whose stand-in packed kernel (like vLLM's CPU oneDNN one) holds
    its own copy of the weight, plus a plain parameter the forward reads directly."""

    def repack(mod: Any, remove_weight: bool) -> None:
        packed = mod.weight.detach().clone()  # the kernel owns its words
        mod.cpu_linear = lambda x, weight, bias: x @ packed.t()

    model = torch.nn.Module()
    for name in ("q", "o"):
        mod = torch.nn.Module()
        mod.weight = torch.nn.Parameter(torch.randn(6, 4).to(torch.bfloat16), requires_grad=False)
        repack(mod, False)
        mod._rollpatch_repack = repack
        mod._rollpatch_owns = mod._rollpatch_kernel_only = True
        model.add_module(name, mod)
    model.norm = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16), requires_grad=False)
    return model


def test_kernel_only_words_are_written_after_the_pause() -> None:
    """A parameter served only through its prebuilt kernel is written after the pause: the
    commit writes the plain parameter and swaps the kernels; the kernel-only words reach the
    target in the background (readers wait for them, the audit skips meanwhile); a word changed
    behind the digests there after staging is caught by the check and taints the engine."""
    torch = pytest.importorskip("torch")
    from rollpatch import native

    if native.core is None:
        pytest.fail("the native core is not built (pip install -e .)", pytrace=False)
    torch.manual_seed(1)
    model = _packed_model(torch)
    w = _weights(model, alias=True)

    def words() -> dict[str, np.ndarray]:
        return {
            n: p.detach().view(torch.int16).numpy().view(np.uint16).copy()
            for n, p in model.named_parameters()
        }

    def flat(view: Any) -> dict[str, list[int]]:
        return {n: view[n].data.tolist() for n in view}

    def live() -> dict[str, list[int]]:
        return {n: a.reshape(-1).tolist() for n, a in words().items()}

    def served(mod: Any) -> np.ndarray:
        x = torch.eye(4).to(torch.bfloat16)
        return mod.cpu_linear(x, None, None).t().contiguous().view(torch.int16).numpy()

    views = [vllm_layouts.words_view(words())]
    for k in (1, 2):
        nxt = vllm_layouts.words_view({n: a.copy() for n, a in words().items()})
        for n in nxt:
            nxt[n].data[k::3] ^= 0x0001  # low mantissa bit: exact through the identity matmul
            nxt.invalidate(n)
        views.append(nxt)
        staged = w.stage(diff(views[k - 1], nxt))
        w.commit_staged(staged)
        assert w.last_phases["written_after"] == 2.0  # q.weight and o.weight
        for name in ("q", "o"):  # served from the swapped kernels at once
            got = served(getattr(model, name)).view(np.uint16).reshape(-1)
            assert got.tolist() == nxt[f"{name}.weight"].data.tolist()
        assert live()["norm"] == flat(nxt)["norm"]  # written in the pause
        w.settler.wait()
        assert live() == flat(nxt)
        assert w.settler.last["error"] is None and w.digests(fresh=True) == nxt.tensor_digests()
    # a word of q.weight changed behind the digests after staging: the kernel was built from
    # the checked copy, and the words written after the pause find the difference
    v3 = vllm_layouts.words_view({n: a.copy() for n, a in words().items()})
    v3["q.weight"].data[0] ^= 0x0001
    v3.invalidate("q.weight")
    staged = w.stage(diff(views[2], v3))
    model.q.weight.detach().view(torch.int16).view(-1)[0] ^= 4
    w.commit_staged(staged)
    w.settler.wait()
    assert w.tainted == "q.weight" and w.settler.last["error"] is not None
    assert w.audit(1 << 20).tensors > 0  # the audit runs again once the writes are done


def test_prebuilt_kernels_are_packed_from_one_reused_copy() -> None:
    """Kernel-only modules' weight copies share one buffer, reused module by module (it grows
    for a larger module): each kernel packs its own copy of the words, so every module still
    serves exactly its target words after the swap, whatever was copied into the buffer after
    its kernel was built."""
    torch = pytest.importorskip("torch")
    from rollpatch import native

    if native.core is None:
        pytest.fail("the native core is not built (pip install -e .)", pytrace=False)
    torch.manual_seed(2)
    model = _packed_model(torch)
    for name, rows in (("up", 10), ("down", 3)):  # sorted after o and q: larger, then smaller
        mod = torch.nn.Module()
        mod.weight = torch.nn.Parameter(
            torch.randn(rows, 4).to(torch.bfloat16), requires_grad=False
        )
        mod._rollpatch_repack = model.q._rollpatch_repack
        mod._rollpatch_repack(mod, False)
        mod._rollpatch_owns = mod._rollpatch_kernel_only = True
        model.add_module(name, mod)
    w = _weights(model, alias=True)
    base = vllm_layouts.words_view(
        {
            n: p.detach().view(torch.int16).numpy().view(np.uint16).copy()
            for n, p in model.named_parameters()
        }
    )
    nxt = vllm_layouts.words_view({n: base[n].data.reshape(base[n].shape) for n in base})
    for n in nxt:
        nxt[n].data[1::2] ^= 0x0001  # low mantissa bits: exact through the identity matmul
        nxt.invalidate(n)
    w.commit_staged(w.stage(diff(base, nxt)))
    x = torch.eye(4).to(torch.bfloat16)
    for name in ("q", "o", "up", "down"):
        got = getattr(model, name).cpu_linear(x, None, None).t().contiguous()
        assert got.view(torch.int16).numpy().view(np.uint16).reshape(-1).tolist() == (
            nxt[f"{name}.weight"].data.tolist()
        )
    w.settler.wait()
    assert w.digests(fresh=True) == nxt.tensor_digests()


def test_double_buffered_commit_exchanges_buffers_built_while_staging() -> None:
    """``double_buffer``: each touched parameter's second buffer is written, checked and read
    back while staging (the live words untouched), exchanged under the pause with the kernels
    built from it; the reads alias the new storage; a word changed behind the digests before
    staging is refused; the engine's other paths (audit, next stage) see the new words."""
    torch = pytest.importorskip("torch")
    from rollpatch import native

    if native.core is None:
        pytest.fail("the native core is not built (pip install -e .)", pytrace=False)
    torch.manual_seed(2)
    model = _packed_model(torch)
    model.t = torch.nn.Parameter(torch.randn(5, 3).to(torch.bfloat16).t(), requires_grad=False)
    w = _weights(model)

    def live() -> dict[str, list[int]]:
        return {
            n: p.detach().view(torch.int16).numpy().view(np.uint16).reshape(-1).tolist()
            for n, p in model.named_parameters()
        }

    def view_of(words: dict[str, list[int]]) -> Any:
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        return vllm_layouts.words_view(
            {n: np.array(a, np.uint16).reshape(shapes[n]) for n, a in words.items()}
        )

    v = [view_of(live())]
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    for k in (1, 2):
        nxt = view_of(live())
        for n in nxt:
            nxt[n].data[k::2] ^= 0x0001
            nxt.invalidate(n)
        before = live()
        staged = w.stage(diff(v[-1], nxt), mode="double_buffer")
        assert live() == before  # staging wrote only the second buffers
        w.commit_staged(staged)
        assert w.last_phases["exchange_ms"] >= 0 and w.last_phases["write_ms"] == 0.0
        assert live() == {n: nxt[n].data.tolist() for n in nxt}
        assert all(p.data_ptr() != storage[n] for n, p in model.named_parameters())
        storage = {n: p.data_ptr() for n, p in model.named_parameters()}
        x = torch.eye(4).to(torch.bfloat16)
        got = model.q.cpu_linear(x, None, None).t().contiguous().view(torch.int16).numpy()
        assert got.view(np.uint16).reshape(-1).tolist() == nxt["q.weight"].data.tolist()
        assert w.digests(fresh=True) == nxt.tensor_digests()  # reads alias the new storage
        assert w.audit(1 << 20).mismatched == ()
        v.append(nxt)
    bad = view_of(live())
    bad["t"].data[0] ^= 0x0001
    bad.invalidate("t")
    patch = diff(v[-1], bad)
    model.t.detach().view(torch.int16).t().reshape(-1)[0] ^= 2  # behind the digests
    with pytest.raises(BaseMismatchError):
        w.stage(patch, mode="double_buffer")


def test_catch_up_decodes_each_step_into_one_copy(tmp_path: Any) -> None:
    """A chain of published steps decoded in place (one copy per touched tensor, every step
    decoded into it) composes to exactly what decoding each step against an overlay gives,
    and to diff(first, last); a corrupt step is refused and the live words stay untouched."""
    from rollpatch.engines.catchup import decode_in_place
    from rollpatch.engines.vllm import ops
    from rollpatch.patch import compose, decode, encode
    from rollpatch.patch.overlay import Overlay
    from rollpatch.view import sum128

    ck = vllm_layouts.checkpoint()
    cks = [ck]
    for seed in (1, 2, 3):
        cks.append(vllm_layouts.random_step(cks[-1], seed, share=0.03))
    views = [vllm_layouts.words_view(c) for c in cks]
    ranks = vllm_layouts.SimulatedRanks(ck, 1)
    w = ranks.weights[0]
    steps, blobs = [], []
    for k in range(1, len(views)):
        blob = encode(diff(views[k - 1], views[k]), views[k - 1])
        path = tmp_path / f"s{k}.rpatch"
        path.write_bytes(blob)
        steps.append(
            {"base": views[k - 1].digest(), "target": views[k].digest(), "paths": [str(path)]}
        )
        blobs.append([blob])
    out = decode_in_place(w, steps, blobs, w.state_of)
    assert out is not None
    got, states = out
    overlay = None
    for blob in blobs:
        one = decode(blob[0], w if overlay is None else Overlay(w, overlay), check_base=False)
        overlay = one if overlay is None else compose(overlay, one)
    assert overlay is not None and got.equals(overlay)
    assert got.equals(diff(views[0], views[-1]))
    assert states == {n: sum128(views[-1][n].data) for n in got.tensors}  # proven states
    chained, known, vouched = ops._chain(w, steps)  # the worker takes this path at TP 1
    assert chained.equals(got) and known == states and vouched == {}
    one, one_known, _ = ops._chain(w, steps[:1])  # one step: decoded against the live words
    assert one.equals(diff(views[0], views[1]))
    assert one_known == {n: sum128(views[1][n].data) for n in one.tensors}
    before = {n: w[n].data.copy() for n in w.names()}
    bad = bytearray(blobs[1][0])
    bad[-5] ^= 0xFF  # a payload byte: its BLAKE3 no longer matches
    with pytest.raises(Exception) as err:
        decode_in_place(w, steps, [blobs[0], [bytes(bad)], blobs[2]], w.state_of)
    assert "checksum" in str(err.value)
    assert all(np.array_equal(w[n].data, before[n]) for n in w.names())
    # a wrong proven state is caught: the target digest is checked against it
    liar = dict(states)
    name = min(liar)
    liar[name] = (liar[name][0] ^ 1, liar[name][1])
    with pytest.raises(TargetMismatchError):
        w.stage(got, known=liar)
    w.commit_staged(w.stage(got, known=states))
    assert w.root() == views[-1].digest()
    assert w.digests(fresh=True) == views[-1].tensor_digests()


def test_sidecar_engines_take_the_write_mode() -> None:
    """``rollpatch sidecar --writes``: the vLLM and SGLang adapters take it; an unknown mode
    is a ConfigError."""
    from rollpatch.errors import ConfigError
    from rollpatch.sidecar.server import make_engine

    for kind in ("vllm", "sglang"):
        engine, _ = make_engine(kind, engine_url="http://127.0.0.1:9", writes="double_buffer")
        assert engine.writes == "double_buffer"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError):
        VllmEngine("http://127.0.0.1:9", writes="both")  # type: ignore[arg-type]


@pytest.mark.parametrize("alias", [True, False])
def test_a_tied_heads_own_kernel_follows_the_embedding(alias: bool) -> None:
    """A tied LM head holds the embedding's parameter under another name (vLLM:
    ``lm_head.weight`` is ``model.embed_tokens.weight``, listed once) and its CPU kernel its
    own packed copy: a commit that writes the embedding rebuilds the head's kernel from the
    new words (prebuilt while staging on the CPU path), and the embedding's words, which its
    lookup reads, are written in the pause (not deferred as kernel-only)."""
    torch = pytest.importorskip("torch")
    from rollpatch.engines.vllm.params import TorchParams

    torch.manual_seed(2)

    def repack(mod: Any, remove_weight: bool) -> None:
        packed = mod.weight.detach().clone()
        mod.cpu_linear = lambda x, weight, bias: x @ packed.t()

    model = torch.nn.Module()
    model.embed = torch.nn.Module()
    model.embed.weight = torch.nn.Parameter(
        torch.randn(8, 4).to(torch.bfloat16), requires_grad=False
    )
    model.head = torch.nn.Module()
    model.head.weight = model.embed.weight  # tied
    repack(model.head, False)
    model.head._rollpatch_repack = repack
    model.head._rollpatch_owns = model.head._rollpatch_kernel_only = True
    assert [n for n, _ in model.named_parameters()] == ["embed.weight"]
    params = TorchParams(model, 1, alias=alias)
    assert params.alias_of == {"head.weight": "embed.weight"}
    assert not params.kernel_only("embed.weight")  # the embedding's lookup reads the words
    w = _weights(model, alias=alias)

    def words() -> np.ndarray:
        return model.embed.weight.detach().view(torch.int16).numpy().view(np.uint16).copy()

    v0 = vllm_layouts.words_view({"embed.weight": words()})
    v1 = vllm_layouts.words_view({"embed.weight": words()})
    v1["embed.weight"].data[::3] ^= 0x0101
    v1.invalidate("embed.weight")
    w.commit(diff(v0, v1))
    assert np.array_equal(words().reshape(-1), v1["embed.weight"].data)
    x = torch.eye(4).to(torch.bfloat16)
    logits = model.head.cpu_linear(x, model.head.weight, None)
    assert torch.equal(logits, x @ model.embed.weight.t())  # the head serves the new words
