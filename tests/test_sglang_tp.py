"""SGLang at tensor parallelism > 1, offline: every rank's blocks of the synthetic fused layout
(q/k/v and gate/up column-split, o/down row-split, the padded vocabulary, replicated KV heads
at TP 4, a replicated norm), as the weight loaders written after vLLM's/SGLang's place them
(``tests.vllm_layouts.vllm_load``).

The ranks' partial rp.sum128 sums add up to the published digests (each distinct block once);
staging a decoded patch on every rank moves the sums to the target digests (checked before any
rank writes); commits scatter only what each rank holds; an undo restores a rank's words;
refusals leave the words untouched.

Live (the venv from ``scripts/sglang-env``; its own SGLang server at ``--tp-size 2``, one core
per rank, booted from version 0 of the tiny Llama of tests/test_sglang.py): the adapter
verifies the booted weights from the ranks' sums; each version's published patch object is
decoded against the words gathered from both ranks and staged on both, committed under
SGLang's pause; after each commit the re-hashed weights give the published digest and
``weight_version`` names the version; SGLang's own full reload of a version at TP 2 serves
bit-identically; a reverse transition restores the outputs; a tampered patch is refused with
SGLang serving its last good version. Without the venv the live test is SKIPPED, loudly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rollpatch.engines.sglang.ranked import RankWeights
from rollpatch.engines.sglang.slices import combine
from rollpatch.engines.vllm.layout import placements
from rollpatch.errors import BaseMismatchError, EngineError
from rollpatch.kinds import get_kind
from rollpatch.patch import Patch, diff
from rollpatch.view import View
from tests import vllm_env, vllm_layouts


def _ranks(tp: int, ck: dict[str, np.ndarray], kv_heads: int = 2) -> list[RankWeights]:
    specs = vllm_layouts.layer_specs(tp, kv_heads)
    out = []
    for rank in range(tp):
        loaded = vllm_layouts.vllm_load(ck, tp, rank, kv_heads)
        params = {
            s.param: loaded[s.param].reshape(vllm_layouts.param_shape(s, tp)).copy() for s in specs
        }
        kinds = {s.param: get_kind("bf16") for s in specs}
        out.append(RankWeights(params, specs, kinds, rank=rank, tp=tp))
    return out


def _tensors(view: View) -> dict[str, list[object]]:
    return {n: [t.kind.name, list(t.shape)] for n, t in view.items()}


def _held(ranks: list[RankWeights], view: View) -> tuple[dict[str, str], str]:
    return combine([r.blocks() for r in ranks], _tensors(view))


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_sums_add_up_to_the_published_digests(tp: int) -> None:
    ck = vllm_layouts.checkpoint(0)
    a = vllm_layouts.words_view(ck)
    ranks = _ranks(tp, ck)
    assert any(not pl.whole for s in vllm_layouts.layer_specs(tp) for pl in placements(s, 0, tp))
    assert _held(ranks, a) == (a.tensor_digests(), a.digest())
    reports = [r.blocks() for r in ranks]
    reports[-1] = {n: b for n, b in reports[-1].items() if n != "down_proj.weight"}
    with pytest.raises(EngineError, match="cover"):  # a rank's block missing
        combine(reports, _tensors(a))


@pytest.mark.parametrize("tp", [2, 4])
def test_staged_rank_commits_reach_the_target_and_undo(tp: int) -> None:
    ck = vllm_layouts.checkpoint(1)
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 7))
    ranks = _ranks(tp, ck)
    before = [{p: v.copy() for p, v in r.params.items()} for r in ranks]
    patch = diff(a, b)
    staged = [r.stage(patch) for r in ranks]
    assert all(
        np.array_equal(before[i][p], r.params[p]) for i, r in enumerate(ranks) for p in r.params
    )
    digests, _ = combine([s.blocks for s in staged], {n: _tensors(a)[n] for n in patch.tensors})
    assert digests == {n: tp_.target_digest for n, tp_ in patch.tensors.items()}
    for r, s in zip(ranks, staged):
        r.commit(s.token)
    assert _held(ranks, b) == (b.tensor_digests(), b.digest())
    assert combine([r.blocks(fresh=True) for r in ranks], _tensors(b))[1] == b.digest()
    want = _ranks(tp, vllm_layouts.random_step(ck, 7))  # what a fresh load of b puts where
    for r, w in zip(ranks, want):
        assert all(np.array_equal(r.params[p], w.params[p]) for p in r.params)
    ranks[0].undo(staged[0].token)  # another rank failed: this one goes back
    assert all(np.array_equal(before[0][p], ranks[0].params[p]) for p in ranks[0].params)
    with pytest.raises(EngineError, match="undo"):
        ranks[0].undo(staged[0].token)


def test_rank_refusals_leave_the_words_untouched() -> None:
    ck = vllm_layouts.checkpoint(2)
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 3))
    ranks = _ranks(2, ck)
    snap = [{p: v.copy() for p, v in r.params.items()} for r in ranks]
    good = diff(a, b)
    name = "down_proj.weight"  # row-split: each rank holds half of every row
    tp_ = good.tensors[name]
    ch = tp_.changes()
    bad_old = dataclasses.replace(tp_, change=dataclasses.replace(ch, old=ch.new))
    with pytest.raises(BaseMismatchError):
        ranks[1].stage(Patch(good.base, good.target, {**good.tensors, name: bad_old}, {}))
    with pytest.raises(EngineError, match="double-buffered"):
        ranks[0].stage(good, "double_buffer")
    with pytest.raises(EngineError, match="split"):
        ranks[0][name]
    staged = ranks[0].stage(good)
    ranks[0].commit(ranks[0].stage(good).token)  # staged again: the first token is gone
    with pytest.raises(EngineError, match="no staged update"):
        ranks[0].commit(staged.token)
    assert all(np.array_equal(snap[1][p], ranks[1].params[p]) for p in ranks[1].params)
    flipped = ranks[1].params["o_proj.weight"]
    flipped[0, 0] ^= 1
    bad = ranks[1].audit(1 << 30)["mismatched"]
    assert bad == ["o_proj.weight"]


class RanksChannel:
    """The adapter's channel over in-process ranks (what the loader answers, per rank)."""

    def __init__(self, ranks: list[RankWeights]) -> None:
        self.ranks, self.tp, self.fail_rank = ranks, len(ranks), -1
        self.calls: list[list[str]] = []

    def control(self, op: str, *, rank: int = 0, **args: object) -> dict[str, object]:
        from rollpatch.engines.vllm.transfer import read_decoded

        w = self.ranks[rank]
        if op == "digest":
            return {"blocks": w.blocks(fresh=bool(args.get("fresh")))}
        if op == "stage_decoded":
            paths = args["paths"]
            assert isinstance(paths, list)
            return {**w.stage(read_decoded(str(paths[0]))).summary(), "ms": 1.0}
        assert op == "drop"
        w.staged.clear()
        return {"ok": True}

    def commands(self, cmds: list[dict[str, str]], *, flush: bool) -> list[dict[str, object]]:
        self.calls.append([c["op"] for c in cmds])
        out: list[dict[str, object]] = []
        for r, c in enumerate(cmds):
            if c["op"] == "commit" and r == self.fail_rank:
                out.append({"ok": False, "error": {"type": "TargetMismatchError", "message": "x"}})
            elif c["op"] == "commit":
                out.append({"ok": True, "changed": self.ranks[r].commit(c["token"]).changed})
            elif c["op"] == "undo":
                out.append({"ok": True, **self.ranks[r].undo(c["token"])})
            else:
                out.append({"ok": True})
        return out


def test_adapter_proves_the_ranks_sum_and_undoes_a_partial_commit(tmp_path: Path) -> None:
    """tp.stage checks the ranks' moved sums against the target before anyone writes; when a
    rank's commit fails, the ranks that wrote undo it and every rank is on the base again."""
    from rollpatch.engines.sglang import tp as tp_ops
    from rollpatch.engines.vllm.transfer import write_decoded
    from rollpatch.errors import TargetMismatchError

    ck = vllm_layouts.checkpoint(4)
    a = vllm_layouts.words_view(ck)
    b = vllm_layouts.words_view(vllm_layouts.random_step(ck, 9))
    ranks = _ranks(2, ck)
    ch = RanksChannel(ranks)
    tensors = _tensors(a)
    assert tp_ops.held(ch, tensors, fresh=True) == (a.tensor_digests(), a.digest())  # type: ignore[arg-type]
    snap = [{p: v.copy() for p, v in r.params.items()} for r in ranks]
    patch, path = diff(a, b), tmp_path / "patch.bin"
    write_decoded(patch, path)
    tampered = diff(a, b)
    tampered.tensors["o_proj.weight"].changes().new[0] ^= np.uint16(1)
    write_decoded(tampered, tmp_path / "bad.bin")
    with pytest.raises(TargetMismatchError):
        tp_ops.stage(ch, tampered, tmp_path / "bad.bin", a.tensor_digests(), tensors)  # type: ignore[arg-type]
    assert all(not r.staged for r in ranks)  # dropped everywhere
    tokens, summary = tp_ops.stage(ch, patch, path, a.tensor_digests(), tensors)  # type: ignore[arg-type]
    assert summary["digests"] == {n: t.target_digest for n, t in patch.tensors.items()}
    ch.fail_rank = 1
    with pytest.raises(TargetMismatchError):
        tp_ops.commit(ch, tokens)  # type: ignore[arg-type]
    assert ch.calls == [["commit", "commit"], ["undo", "noop"]]
    for r, before in zip(ranks, snap):
        assert all(np.array_equal(before[p], r.params[p]) for p in r.params)
    assert tp_ops.held(ch, tensors, fresh=True)[1] == a.digest()  # type: ignore[arg-type]
    ch.fail_rank = -1
    tokens, _ = tp_ops.stage(ch, patch, path, a.tensor_digests(), tensors)  # type: ignore[arg-type]
    tp_ops.commit(ch, tokens)  # type: ignore[arg-type]
    assert tp_ops.held(ch, tensors, fresh=True) == (b.tensor_digests(), b.digest())  # type: ignore[arg-type]


# -- live: SGLang at --tp-size 2 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[vllm_env.Server, Path]]:
    from tests import live_servers
    from tests.sglang_env import BUILD_HINT, sglang_python, start_server, venv_dir

    python = sglang_python()
    if python is None:
        pytest.skip(f"SKIPPED LIVE SGLANG TP TEST: no SGLang venv at {venv_dir()}: {BUILD_HINT}")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED LIVE SGLANG TP TEST: --tp-size 2 needs 2 cores here")
    pytest.importorskip("transformers")
    from rollpatch.engines.reference import make_tiny_model

    root = tmp_path_factory.mktemp("sglang-tp")
    with contextlib.redirect_stderr(io.StringIO()):
        make_tiny_model(root / "model", **live_servers.LIVE_MODEL)
    shim = root / "sgl-kernel-shim.log"
    srv = start_server(python, root / "model", root / "sglang.log", shim, tp=2)
    try:
        srv.wait_ready(600)
        yield srv, root
    finally:
        srv.stop()
    calls = shim.read_text() if shim.exists() else ""
    assert not calls, f"SGLang called the sgl_kernel import shim:\n{calls}"


def test_live_tp2_versions_forward_back_and_refusals(
    tp_server: tuple[vllm_env.Server, Path],
) -> None:
    from rollpatch.engines.sglang import SglangEngine
    from rollpatch.errors import TargetMismatchError
    from rollpatch.patch import decode
    from tests.test_sglang import World, greedy

    server, root = tp_server
    world = World(root / "world", root / "model")
    engine = SglangEngine(server.url)
    try:
        assert engine.tp == 2 and engine.info()["tp"] == 2
        engine.adopt(0, world.views[0].digest())  # the ranks' sums add up to version 0
        seen = [greedy(server)[0]]
        last = 3
        for v in range(1, last + 1):
            a, b = world.views[v - 1], world.views[v]
            assert engine.stage_encoded([], v) is None  # decoded here, against gathered words
            patch = decode(world.patch_object(v), engine.words())
            engine.apply(patch, v)
            assert engine.version == v and engine.digest == b.digest()
            assert engine.held(fresh=True) == (b.tensor_digests(), b.digest())
            out, tags = greedy(server)
            assert tags == {str(v)} and out != seen[-1]
            seen.append(out)
        assert engine.words()["model.layers.0.mlp.down_proj.weight"].data.tobytes() == (
            world.views[last]["model.layers.0.mlp.down_proj.weight"].data.tobytes()
        )  # a row-split tensor, gathered from both ranks
        engine.apply(diff(world.views[last], world.views[last - 1]), last - 1)  # back
        assert engine.held(fresh=True)[1] == world.views[last - 1].digest()
        assert greedy(server) == (seen[last - 1], {str(last - 1)})
        a, b = world.views[last - 1], world.views[last]
        tampered = diff(a, b)
        name = "model.layers.1.self_attn.o_proj.weight"
        tampered.tensors[name].changes().new[0] ^= np.uint16(0x8000)
        with pytest.raises(TargetMismatchError):
            engine.apply(tampered, last)
        assert engine.version == last - 1 and engine.held(fresh=True)[1] == a.digest()
        assert greedy(server) == (seen[last - 1], {str(last - 1)})
        r = server.post(  # SGLang's own full reload of the last version, at TP 2
            "/update_weights_from_disk",
            {"model_path": str(world.dirs[last]), "weight_version": f"disk-{last}"},
        )
        assert r["success"], r
        assert greedy(server) == (seen[last], {f"disk-{last}"})
        engine.adopt(last, world.views[last].digest())
        audit = engine.audit(1 << 30)
        assert audit is not None and audit.mismatched == () and audit.wrapped
    finally:
        engine.close()
