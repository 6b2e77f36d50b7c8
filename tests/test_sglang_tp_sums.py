"""A tensor-parallel rank's block sum change, natively (the dry ``apply`` with a word map,
``slices.word_map``) against the numpy reference (``slices.partial_delta``) and against
re-hashing the block (``slices.partial_state``): every placement of the synthetic layouts
at TP 1, 2 and 4 (column, row, vocabulary, replicated, fused), and blocks whose edges fall
inside an 8-byte word, which take the reference (no word map)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollpatch import native
from rollpatch.engines.sglang.slices import partial_delta, partial_state, word_map
from rollpatch.engines.sumchange import dry_change
from rollpatch.engines.vllm.layout import Placement, locate, placements
from rollpatch.errors import BaseMismatchError
from rollpatch.kinds import get_kind
from tests import vllm_layouts

_M64 = (1 << 64) - 1
BF16 = get_kind("bf16")

pytestmark = pytest.mark.skipif(native.core is None, reason="the native core is not built")


def _changes(pl: Placement, rng: np.random.Generator, param: np.ndarray) -> tuple:
    """Random changed positions of ``pl``'s tensor that this rank holds: checkpoint positions,
    parameter offsets, old and new words."""
    pos = np.flatnonzero(rng.random(pl.n_elements) < 0.2).astype(np.int64)
    held, offsets = locate(pl, pos)
    pos = pos[held]
    old = param.reshape(-1)[offsets]
    new = (old ^ rng.integers(1, 1 << 16, old.size, dtype=np.uint16)).astype(np.uint16)
    return pos, offsets, old, new


def _moved(pl: Placement, param: np.ndarray, offsets: np.ndarray, new: np.ndarray) -> tuple:
    """The block's sum change by re-hashing it before and after the writes."""
    _, _, _, a0, a1 = partial_state(pl, param)
    after = param.copy()
    after.reshape(-1)[offsets] = new
    _, _, _, b0, b1 = partial_state(pl, after)
    return (b0 - a0) & _M64, (b1 - a1) & _M64


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_native_block_change_is_the_reference(tp: int) -> None:
    rng = np.random.default_rng(tp)
    ck = vllm_layouts.checkpoint(3)
    mapped = 0
    for spec in vllm_layouts.layer_specs(tp):
        for rank in range(tp):
            loaded = vllm_layouts.vllm_load(ck, tp, rank, 2)
            param = loaded[spec.param].reshape(vllm_layouts.param_shape(spec, tp)).copy()
            for pl in placements(spec, rank, tp):
                pos, offsets, old, new = _changes(pl, rng, param)
                want = partial_delta(pl, param, pos, new)
                assert want == _moved(pl, param, offsets, new), pl.name
                jmap = word_map(pl, 2)
                if jmap is None:
                    continue
                mapped += 1
                got = dry_change(BF16, param.reshape(-1), offsets, old, new, pl.name, jmap=jmap)
                assert got == want, (pl.name, rank, pl.dim)
    assert mapped > 0


def test_blocks_cut_inside_a_word_take_the_reference() -> None:
    """A column block starting at column 2 of BF16 rows (inside an 8-byte word), a row block
    of a 1-D tensor of odd length, an expert slot: no word map."""
    pl = Placement("w", "p", (8, 12), (8, 6), 1, 2, 0, 6)
    assert word_map(pl, 2) is None
    assert word_map(dataclasses.replace(pl, src_start=4, length=4, param_shape=(8, 4)), 2)
    odd = Placement("b", "p", (7,), (7, 1), 0, 0, 0, 7)
    assert word_map(odd, 2) is None
    slot = Placement("e", "p", (4, 8), (2, 32), 0, 0, 0, 4, slot=1, sub=(4, 8))
    assert word_map(slot, 2) is None


def test_a_mapped_change_checks_the_old_words() -> None:
    spec = vllm_layouts.layer_specs(2)[2]  # o_proj: a row split, a column block per rank
    ck = vllm_layouts.checkpoint(4)
    loaded = vllm_layouts.vllm_load(ck, 2, 1, 2)
    param = loaded[spec.param].reshape(vllm_layouts.param_shape(spec, 2)).copy()
    (pl,) = placements(spec, 1, 2)
    jmap = word_map(pl, 2)
    assert jmap is not None and jmap[1] > 0  # rows of the block: a word skip per row
    _, offsets, old, new = _changes(pl, np.random.default_rng(0), param)
    bad = old.copy()
    bad[len(bad) // 2] ^= 1
    with pytest.raises(BaseMismatchError, match="old elements"):
        dry_change(BF16, param.reshape(-1), offsets, bad, new, pl.name, jmap=jmap)
