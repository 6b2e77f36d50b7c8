"""vLLM as a rollout engine, offline (no vLLM needed): the layout arithmetic against vLLM's
weight loaders at TP 1/2/4, commits over tensor-parallel ranks simulated with threads and a
barrier all-gather, the decoded-patch file, the worker's access to torch parameters and the
adapter's commit protocol against a stand-in server. The live tests: tests/test_vllm.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.vllm import VllmEngine, layout, tensorblocks
from rollpatch.engines.vllm.layout import ParamSpec, Shard
from rollpatch.engines.vllm.transfer import read_decoded, write_decoded
from rollpatch.engines.vllm.weights import RuntimeWeights
from rollpatch.engines.writing import check_and_write
from rollpatch.errors import (
    BaseMismatchError,
    EngineError,
    PatchDecodeError,
    PatchError,
    TargetMismatchError,
)
from rollpatch.kinds import get_kind
from rollpatch.patch import DeltaOp, Patch, TensorPatch, diff
from tests import vllm_env, vllm_layouts

TPS = [(1, 2), (2, 2), (4, 2), (4, 4), (2, 1)]


@pytest.mark.parametrize(("tp", "kv_heads"), TPS)
def test_layout_matches_vllm_loaders(tp: int, kv_heads: int) -> None:
    specs = vllm_layouts.layer_specs(tp, kv_heads)
    ck = vllm_layouts.checkpoint(kv_heads=kv_heads)
    assert set(layout.check_coverage(specs, tp)) == set(ck)
    rng = np.random.default_rng(tp)
    loaded = [vllm_layouts.vllm_load(ck, tp, r, kv_heads) for r in range(tp)]
    for spec in specs:
        shape = layout.param_shape(spec, tp)
        for r in range(tp):
            arr = loaded[r][spec.param].reshape(shape)
            for pl in layout.placements(spec, r, tp):
                src = ck[pl.name].reshape(-1)
                pos = np.unique(rng.integers(0, src.size, 500))
                held, off = layout.locate(pl, pos)
                assert np.array_equal(arr.reshape(-1)[off], src[pos[held]])
                assert tensorblocks.block_shape(pl) == tensorblocks.extract(pl, arr).shape, pl
                rows = layout.locate_rows(pl, pos.astype(np.int64))
                if rows is not None:  # the fast path for row blocks: the same, by slices
                    assert pl.dim == 0 and pl.sub is None, pl
                    keep, off2 = rows
                    assert np.array_equal(pos[keep], pos[held]) and np.array_equal(off2, off)
        for i, sh in enumerate(spec.shards):
            per_rank = [layout.placements(spec, r, tp)[i] for r in range(tp)]
            params = [loaded[r][spec.param].reshape(shape) for r in range(tp)]
            assert np.array_equal(tensorblocks.assemble(per_rank, params), ck[sh.name].reshape(-1))
            held = [
                np.ascontiguousarray(tensorblocks.extract(pl, p)) for pl, p in zip(per_rank, params)
            ]
            assert np.array_equal(
                tensorblocks.assemble_blocks(per_rank, held), ck[sh.name].reshape(-1)
            )
            everything = np.arange(ck[sh.name].size)  # held by 1 rank, or by each replica
            owners = sum(layout.locate(pl, everything)[0].astype(int) for pl in per_rank)
            want = tp if spec.kind == "replicated" else sh.replicas
            assert np.all(owners == want), (sh.name, tp)


def test_layout_refuses_bad_specs() -> None:
    with pytest.raises(EngineError, match="divide"):
        layout.param_shape(ParamSpec("w", "row", (Shard("w", (4, 6)),)), 4)
    with pytest.raises(EngineError, match="per-rank"):
        layout.param_shape(ParamSpec("w", "column", (Shard("w", (8, 4), 3),)), 2)
    with pytest.raises(EngineError, match="mapped twice"):
        layout.check_coverage(
            [
                ParamSpec("a", "replicated", (Shard("x", (2,)),)),
                ParamSpec("b", "replicated", (Shard("x", (2,)),)),
            ],
            1,
        )
    with pytest.raises(EngineError, match="fuse"):
        ParamSpec("w", "row", (Shard("a", (2, 2)), Shard("b", (2, 2))))


def test_storage_offsets_on_strided_arrays() -> None:
    base = np.arange(7 * 11, dtype=np.int64).reshape(7, 11)
    for arr in (base, base.T, base[1:6:2, ::3], base.T[::2]):
        flat = np.arange(arr.size)
        elem = [s // arr.itemsize for s in arr.strides]
        off = layout.storage_offsets(flat, arr.shape, elem)
        start = (arr.ctypes.data - base.ctypes.data) // arr.itemsize
        assert np.array_equal(base.reshape(-1)[start + off], arr.reshape(-1))


@pytest.mark.parametrize(("tp", "strided"), [(1, False), (1, True), (2, False), (4, True)])
def test_commit_and_load_across_ranks(tp: int, strided: bool) -> None:
    ck0, ck1 = vllm_layouts.checkpoint(), vllm_layouts.random_step(vllm_layouts.checkpoint(), 1)
    v0, v1 = vllm_layouts.words_view(ck0), vllm_layouts.words_view(ck1)
    ranks = vllm_layouts.SimulatedRanks(ck0, tp, strided)
    assert ranks.run(lambda w: w.root()) == [v0.digest()] * tp
    patch = diff(v0, v1)
    got = ranks.run(lambda w: w.commit(patch))
    assert all(isinstance(g, dict) for g in got), got
    assert ranks.run(lambda w: w.root()) == [v1.digest()] * tp
    for r in range(tp):
        for spec in vllm_layouts.layer_specs(tp):
            want = vllm_layouts.vllm_load(ck1, tp, r)[spec.param].reshape(
                layout.param_shape(spec, tp)
            )
            assert np.array_equal(ranks.params[r][spec.param], want), (r, spec.param)
    assert ranks.repacked and "qkv_proj.weight" in ranks.repacked[0]
    assert ranks.run(lambda w: w.load(v0)) == [v0.digest()] * tp
    assert ranks.run(lambda w: w.root()) == [v0.digest()] * tp


def test_failed_commit_restores_every_rank() -> None:
    ck0 = vllm_layouts.checkpoint()
    v0, v1 = vllm_layouts.words_view(ck0), vllm_layouts.words_view(vllm_layouts.random_step(ck0, 2))
    ranks = vllm_layouts.SimulatedRanks(ck0, 2)
    good = diff(v0, v1)
    name = "o_proj.weight"
    tp = good.tensors[name]
    bad_new = tp.changes().new.copy()
    bad_new[-1] ^= 1  # written, then caught by the target digest
    bad = Patch(
        good.base,
        good.target,
        {
            **good.tensors,
            name: TensorPatch(
                name,
                tp.kind,
                tp.shape,
                tp.base_digest,
                tp.target_digest,
                DeltaOp(tp.changes().positions, tp.changes().old, bad_new),
            ),
        },
    )
    out = ranks.run(lambda w: w.commit(bad))
    assert all(isinstance(e, TargetMismatchError) for e in out), out
    assert ranks.run(lambda w: w.root()) == [v0.digest()] * 2
    assert ranks.run(lambda w: w.digests(fresh=True)) == [v0.tensor_digests()] * 2
    out = ranks.run(lambda w: w.commit(diff(v1, v0)))  # not on that base
    assert all(isinstance(e, BaseMismatchError) for e in out)
    ranks.repacked.clear()
    oob = Patch(
        good.base,
        good.target,
        {
            name: TensorPatch(
                name,
                tp.kind,
                tp.shape,
                tp.base_digest,
                tp.target_digest,
                DeltaOp(
                    tp.changes().positions
                    + vllm_layouts.HID * vllm_layouts.HEADS * vllm_layouts.HD,
                    tp.changes().old,
                    tp.changes().new,
                ),
            )
        },
    )  # type: ignore
    out = ranks.run(lambda w: w.commit(oob))
    assert all(isinstance(e, PatchError) for e in out) and ranks.repacked == []


def test_undo_after_another_rank_failed_restores_every_rank() -> None:
    """Rank 1's commit fails its old-word check (a word changed behind its digests after
    staging) while rank 0 wrote: ``undo_last`` on every rank puts rank 0's old words and
    digests back (rank 1 restored itself), and both failed and undone writes re-pack."""
    ck0 = vllm_layouts.checkpoint()
    v0, v1 = vllm_layouts.words_view(ck0), vllm_layouts.words_view(vllm_layouts.random_step(ck0, 3))
    ranks = vllm_layouts.SimulatedRanks(ck0, 2)
    for w, ps in zip(ranks.weights, ranks.params, strict=True):  # old words checked (as vLLM's)
        w.access = dataclasses.replace(
            w.access,
            swap=lambda p, off, old, new, ps=ps: check_and_write(
                ps[p].reshape(-1), off, old, new, p, readback=True
            ),
        )
    patch = diff(v0, v1)
    staged = ranks.run(lambda w: w.stage(patch))
    w1 = ranks.weights[1]
    pl = w1.placement("o_proj.weight")
    _, off = layout.locate(pl, patch.tensors["o_proj.weight"].changes().positions)
    flat = ranks.params[1][pl.param].reshape(-1)  # C order: storage offsets are flat ones
    flat[off[0]] ^= 1
    ranks.repacked.clear()
    out = ranks.run(lambda w: w.commit_staged(staged[w.rank]))
    assert isinstance(out[0], dict) and isinstance(out[1], BaseMismatchError), out
    assert len(ranks.repacked) == 2  # rank 0's commit; rank 1's failure (words put back)
    assert ranks.run(lambda w: w.root()) == [v1.digest(), v0.digest()]
    assert ranks.run(lambda w: w.undo_last()) == [True, False]
    assert ranks.run(lambda w: w.root()) == [v0.digest()] * 2
    assert ranks.run(lambda w: w.digests(fresh=True)) == [v0.tensor_digests()] * 2
    for r in range(2):
        for spec in vllm_layouts.layer_specs(2):
            want = vllm_layouts.vllm_load(ck0, 2, r)[spec.param].reshape(
                layout.param_shape(spec, 2)
            )
            assert np.array_equal(ranks.params[r][spec.param], want), (r, spec.param)
    assert ranks.run(lambda w: w.undo_last()) == [False, False]  # once only
    assert all(isinstance(g, dict) for g in ranks.run(lambda w: w.commit(patch)))
    assert ranks.run(lambda w: w.root()) == [v1.digest()] * 2
    assert ranks.run(lambda w: w.load(v0)) == [v0.digest()] * 2
    assert ranks.run(lambda w: w.undo_last()) == [False, False]  # a load ends what undo holds


def test_cpu_binding_splits_the_cores_between_ranks() -> None:
    """vLLM's ``auto`` binding wants a NUMA node per rank; ``server_env(tp=...)`` names cores."""
    from rollpatch.engines.vllm.launch import cpu_binding, server_env

    assert cpu_binding(1, [1, 0]) == "0,1"
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [4, 0, 1, 2, 3]) == "0,1,2|3,4"
    assert cpu_binding(3, [0, 1]) == "0|1|0"  # more ranks than cores: shared round-robin
    for bad in (0, -1):
        with pytest.raises(ValueError):
            cpu_binding(bad, [0])
    with pytest.raises(ValueError):
        cpu_binding(2, [])
    assert server_env("/src", {})["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert server_env("/src", {}, tp=2)["VLLM_CPU_OMP_THREADS_BIND"] == cpu_binding(2)


def test_decoded_file_roundtrip_and_hostile(tmp_path: pytest.TempPathFactory) -> None:
    ck0 = vllm_layouts.checkpoint()
    v0, v1 = vllm_layouts.words_view(ck0), vllm_layouts.words_view(vllm_layouts.random_step(ck0, 3))
    patch = diff(v0, v1)
    path = tmp_path / "p.bin"  # type: ignore[operator]
    write_decoded(patch, path)
    assert read_decoded(path).equals(patch)
    raw = path.read_bytes()
    for bad in (
        raw[:-1],
        raw[:100],
        b"\x00" * 16,
        raw.replace(b"delta", b"drop!", 1),
        raw.replace(b"t0.new", b"t0.nex", 1),
    ):
        assert bad != raw
        path.write_bytes(bad)
        with pytest.raises(PatchDecodeError):
            read_decoded(path)


@pytest.mark.parametrize("alias", [True, False])
def test_worker_access_on_torch_parameters(alias: bool) -> None:
    """The worker glue on real torch parameters (one non-contiguous): ``alias`` is the CPU
    path (numpy views), ``alias=False`` the path GPUs take (host copies, torch writes)."""
    torch = pytest.importorskip("torch")
    from rollpatch.engines.vllm.params import TorchParams

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(6, 4).to(torch.bfloat16).requires_grad_(False)
    model.tw = torch.nn.Parameter(
        torch.randn(5, 3).to(torch.bfloat16).t(), requires_grad=False
    )  # (3, 5), column-major storage
    calls: list[object] = []

    def repack(mod: Any, remove_weight: bool) -> None:  # as vLLM's: a kernel from the weight
        calls.append((mod, remove_weight))
        mod.cpu_linear = ("kernel", mod.weight.detach().view(torch.int16).clone())

    model.lin._rollpatch_repack = repack
    model.lin._rollpatch_owns = True  # the stand-in kernel holds its own copy of the words
    specs = [
        ParamSpec(n, "replicated", (Shard(n, tuple(p.shape)),)) for n, p in model.named_parameters()
    ]
    kinds = {s.param: get_kind("bf16") for s in specs}
    w = RuntimeWeights(specs, kinds, TorchParams(model, 1, alias=alias).access())

    def words(p: object) -> np.ndarray:
        return p.detach().view(torch.int16).numpy().view(np.uint16).copy()  # type: ignore

    v0 = vllm_layouts.words_view({n: words(p) for n, p in model.named_parameters()})
    assert w.root() == v0.digest()
    v1 = vllm_layouts.words_view({n: words(p) for n, p in model.named_parameters()})
    for n in v1:
        v1[n].data[::2] ^= 0x0101
        v1.invalidate(n)
    w.commit(diff(v0, v1))
    for n, p in model.named_parameters():
        assert np.array_equal(words(p).reshape(-1), v1[n].data), n
    # CPU: the kernel is built while staging from a copy with the new words, swapped in under
    # the pause; elsewhere (no prebuild) it is rebuilt from the written weight in the pause
    assert len(calls) == 1 and calls[0][1] is False
    assert (calls[0][0] is model.lin) is (not alias)
    assert np.array_equal(
        model.lin.cpu_linear[1].numpy().view(np.uint16).reshape(-1), v1["lin.weight"].data
    )
    assert not model.tw.is_contiguous()
    assert w.load(v0) == v0.digest() and w.digests(fresh=True) == v0.tensor_digests()
    # a kernel that reads the live words (torch's linear on AVX2 hosts) is never rebuilt
    model.lin._rollpatch_owns = False
    calls.clear()
    w.commit(diff(v0, v1))
    assert calls == [] and w.digests(fresh=True) == v1.tensor_digests()


def test_adapter_commit_protocol_offline() -> None:
    """The adapter against a scripted server: call order, version tags, and what it reports
    after failures (previous version when the engine still holds it, else not ready)."""
    v0, v1 = (
        vllm_layouts.words_view(vllm_layouts.checkpoint()),
        vllm_layouts.words_view(vllm_layouts.random_step(vllm_layouts.checkpoint(), 4)),
    )
    fake = vllm_env.FakeVllm(v0.digest())
    eng = VllmEngine("http://127.0.0.1:9", transport="weight-transfer")
    eng.http = fake  # type: ignore[assignment]
    with pytest.raises(EngineError, match="no verified version"):
        eng.apply(diff(v0, v1), 1)
    eng.adopt(0, v0.digest())
    fake.script(True, v1.tensor_digests(), v1.digest())
    eng.apply(diff(v0, v1), 1)
    assert (eng.version, eng.digest) == (1, v1.digest())
    assert [c[0] for c in fake.calls[-7:]] == [
        "/pause?mode=keep",
        "/start_weight_update",
        "/update_weights",
        "rollpatch_result",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert fake.calls[-3][1] == {"weight_version": "1"}
    fake.script(False, error={"type": "TargetMismatchError", "message": "undone"})
    with pytest.raises(TargetMismatchError, match="undone"):
        eng.apply(diff(v1, v0), 0)
    assert (eng.version, eng.digest) == (1, v1.digest())  # the engine still holds v1
    assert ("/finish_weight_update", {"weight_version": None}) in fake.calls[-4:]
    fake.script(
        False,
        error={"type": "EngineError", "message": "lost", "context": {"restored": False}},
        root="0" * 64,
    )
    with pytest.raises(EngineError, match="lost"):
        eng.apply(diff(v1, v0), 0)
    assert (eng.version, eng.digest) == (None, None)
    assert ("/update_weight_version", {"new_version": "rollpatch:not-ready"}) in fake.calls


def test_staging_waits_for_every_rank() -> None:
    """At TP > 1 ranks stage in their own threads: the adapter waits until every rank is
    ready (a ready rank 0 beside a rank still staging is not ready), then requires them to
    agree; a rank that failed raises its error and the other ranks' jobs are discarded."""
    eng = VllmEngine("http://127.0.0.1:9")
    ready = {"ok": True, "state": "ready", "digests": {"a": "d"}, "base": "b", "target": "t"}
    staging = {"ok": True, "state": "staging"}
    failed = {
        "ok": True,
        "state": "failed",
        "failure": {"type": "BaseMismatchError", "message": "held words differ"},
    }
    calls: list[str] = []
    answers: list[list[dict[str, Any]]] = []

    def rpc(method: str, *args: str) -> list[dict[str, Any]]:
        calls.append(method)
        return answers.pop(0)

    eng._rpc = rpc  # type: ignore[method-assign]
    answers += [[ready, staging], [staging, staging], [ready, ready]]
    assert eng._wait_staged("tok")["digests"] == {"a": "d"}
    assert calls == ["rollpatch_staged"] * 3
    calls.clear()
    answers += [[staging, failed], [{"ok": True, "discarded": True}] * 2]
    with pytest.raises(BaseMismatchError, match="held words differ"):
        eng._wait_staged("tok")
    assert calls == ["rollpatch_staged", "rollpatch_discard"]
    answers += [[ready, dict(ready, digests={"a": "other"})]]
    with pytest.raises(EngineError, match="disagree"):
        eng._wait_staged("tok")
    eng.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_hash_their_own_blocks(tp: int) -> None:
    """At TP > 1 a fresh digest or an audit moves no words between ranks: each rank sums its
    block at the words' indices in the tensor and the ranks exchange five integers per
    tensor (replicated blocks counted once); the digests equal the published view's, and a
    word flipped on one rank only is found by every rank's audit."""
    ck0 = vllm_layouts.checkpoint()
    v0 = vllm_layouts.words_view(ck0)
    ranks = vllm_layouts.SimulatedRanks(ck0, tp)
    sizes: list[int] = []
    for w in ranks.weights:
        gather = w.access.gather
        assert gather is not None

        def sized(p: str, local: np.ndarray, gather: Any = gather) -> list[np.ndarray]:
            sizes.append(local.size)
            return gather(p, local)

        w.access = dataclasses.replace(w.access, gather=sized)
    assert ranks.run(lambda w: w.digests(fresh=True)) == [v0.tensor_digests()] * tp
    assert set(sizes) == {5}  # [dim, start, length, s0, s1] per rank and tensor
    clean = ranks.run(lambda w: w.audit(1 << 30))
    assert all(not r.mismatched and r.wrapped for r in clean), clean
    last = ranks.params[tp - 1]["down_proj.weight"]
    last.reshape(-1)[7] ^= 1  # behind every digest, on the last rank only
    found = ranks.run(lambda w: w.audit(1 << 30))
    assert [r.mismatched for r in found] == [("down_proj.weight",)] * tp
    ranks.run(lambda w: w.load(v0))
    ranks.params[tp - 1]["norm.weight"].reshape(-1)[3] ^= 1  # one replica of a whole tensor
    found = ranks.run(lambda w: w.audit(1 << 30))
    assert [r.mismatched for r in found] == [("norm.weight",)] * tp


def test_staging_in_a_thread_or_inline(tmp_path: Path) -> None:
    """``VllmEngine(staging=...)`` reaches the workers in the staging request: ``thread``
    stages beside the engine loop, ``inline`` on it (done when the call returns); any other
    value is refused, by the adapter, the sidecar's ``make_engine`` (vLLM only) and the
    worker's request check."""
    import json

    from rollpatch.engines.vllm.ops import OPS
    from rollpatch.errors import ConfigError
    from rollpatch.patch import encode
    from rollpatch.sidecar.server import make_engine

    ck0 = vllm_layouts.checkpoint()
    v0, v1 = vllm_layouts.words_view(ck0), vllm_layouts.words_view(vllm_layouts.random_step(ck0, 5))
    w = vllm_layouts.SimulatedRanks(ck0, 1).weights[0]
    (tmp_path / "step").write_bytes(encode(diff(v0, v1), v0))
    step = {"base": v0.digest(), "target": v1.digest(), "paths": [str(tmp_path / "step")]}
    spec = tmp_path / "spec.json"
    for where, background in (("inline", False), ("thread", True)):
        spec.write_text(json.dumps({"token": where, "steps": [step], "staging": where}))
        assert OPS["stage"](w, str(spec), "") == {"token": where, "background": background}
        assert w.jobs[where].done.is_set() or background
        assert w.jobs[where].done.wait(60)
        assert OPS["staged"](w, where, "")["target"] == v1.digest()
    spec.write_text(json.dumps({"token": "x", "steps": [step], "staging": "elsewhere"}))
    with pytest.raises(EngineError, match="invalid staging request"):
        OPS["stage"](w, str(spec), "")
    eng = VllmEngine("http://127.0.0.1:9", staging="inline")
    assert eng.staging == "inline"
    eng.close()
    with pytest.raises(ConfigError, match="staging"):
        VllmEngine("http://127.0.0.1:9", staging="elsewhere")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="for --engine vllm"):
        make_engine("sglang", engine_url="http://127.0.0.1:9", staging="inline")


def test_one_adapter_drives_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' side of one sidecar per vLLM (rollpatch.engines.ownership): a claim makes
    an adapter the owner; another adapter's claim is refused while the owner calls, and its
    other calls too (``taken_over``); calls without a token (tools and drills through
    ``/collective_rpc``) are not checked; a takeover after the lease gives the state a new
    identity and drops its staged updates (what the adapter before verified is void); on a
    state no adapter holds (its owner disowned it, or a restarted engine's) the caller's
    first call makes it the owner."""
    from rollpatch.engines import ownership
    from rollpatch.engines.vllm.ops import OPS, check_owner

    clock = [100.0]
    monkeypatch.setattr(ownership, "_clock", lambda: clock[0])
    w = vllm_layouts.SimulatedRanks(vllm_layouts.checkpoint(), 1).weights[0]
    assert OPS["claim"](w, "a", "") == {"owner": "a"}
    check_owner(w, "a")
    check_owner(w, "")  # a tool's call
    with pytest.raises(EngineError, match="vLLM is driven by another rollpatch adapter"):
        OPS["claim"](w, "b", "")
    with pytest.raises(EngineError, match="took this vLLM over") as other:
        check_owner(w, "b")
    assert other.value.context["taken_over"] is True
    with pytest.raises(EngineError, match="owner token"):
        OPS["claim"](w, "", "")
    identity, w.jobs["t"] = w.identity, object()
    clock[0] += ownership.LEASE_S + 0.1  # a's last call was the lease ago: b takes over
    OPS["claim"](w, "b", "")
    assert w.identity != identity and not w.jobs
    with pytest.raises(EngineError, match="took this vLLM over"):
        check_owner(w, "a")
    assert OPS["disown"](w, "", "") == {"disowned": True}
    check_owner(w, "c")  # nobody holds it: c's call makes c the owner
    assert w.ownership.owner == "c"
