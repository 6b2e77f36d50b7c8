"""SGLang at tensor parallelism > 1, offline: every rank's blocks of the synthetic fused layout
(q/k/v and gate/up column-split, o/down row-split, the padded vocabulary, replicated KV heads
at TP 4, a replicated norm), as the weight loaders written after vLLM's/SGLang's place them
(``tests.vllm_env.vllm_load``).

The ranks' partial rp.sum128 sums add up to the published digests (each distinct block once);
staging a decoded patch on every rank moves the sums to the target digests (checked before any
rank writes); commits scatter only what each rank holds; an undo restores a rank's words;
refusals leave the words untouched.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollpatch.engines.sglang.ranked import RankWeights
from rollpatch.engines.sglang.slices import combine
from rollpatch.engines.vllm.layout import placements
from rollpatch.errors import BaseMismatchError, EngineError
from rollpatch.kinds import get_kind
from rollpatch.patch import Patch, diff
from rollpatch.view import View
from tests import vllm_env


def _ranks(tp: int, ck: dict[str, np.ndarray], kv_heads: int = 2) -> list[RankWeights]:
    specs = vllm_env.layer_specs(tp, kv_heads)
    out = []
    for rank in range(tp):
        loaded = vllm_env.vllm_load(ck, tp, rank, kv_heads)
        params = {
            s.param: loaded[s.param].reshape(vllm_env.param_shape(s, tp)).copy() for s in specs
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
    ck = vllm_env.checkpoint(0)
    a = vllm_env.words_view(ck)
    ranks = _ranks(tp, ck)
    assert any(not pl.whole for s in vllm_env.layer_specs(tp) for pl in placements(s, 0, tp))
    assert _held(ranks, a) == (a.tensor_digests(), a.digest())
    reports = [r.blocks() for r in ranks]
    reports[-1] = {n: b for n, b in reports[-1].items() if n != "down_proj.weight"}
    with pytest.raises(EngineError, match="cover"):  # a rank's block missing
        combine(reports, _tensors(a))


@pytest.mark.parametrize("tp", [2, 4])
def test_staged_rank_commits_reach_the_target_and_undo(tp: int) -> None:
    ck = vllm_env.checkpoint(1)
    a = vllm_env.words_view(ck)
    b = vllm_env.words_view(vllm_env.random_step(ck, 7))
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
    want = _ranks(tp, vllm_env.random_step(ck, 7))  # what a fresh load of b puts where
    for r, w in zip(ranks, want):
        assert all(np.array_equal(r.params[p], w.params[p]) for p in r.params)
    ranks[0].undo(staged[0].token)  # another rank failed: this one goes back
    assert all(np.array_equal(before[0][p], ranks[0].params[p]) for p in ranks[0].params)
    with pytest.raises(EngineError, match="undo"):
        ranks[0].undo(staged[0].token)


def test_rank_refusals_leave_the_words_untouched() -> None:
    ck = vllm_env.checkpoint(2)
    a = vllm_env.words_view(ck)
    b = vllm_env.words_view(vllm_env.random_step(ck, 3))
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
