"""MoE expert tensors in vLLM's runtime coordinates, offline: the arithmetic's refusals, and
the CPU kernel's packed experts (:mod:`rollpatch.engines.vllm.experts_cpu`) with a stand-in
prepack (vLLM's own runs in tests/test_moe_vllm_live.py).

The placements themselves are checked against vLLM's own ``RoutedExperts.weight_loader`` in
tests/test_moe_vllm_live.py (the loader runs inside the live MoE server's worker, which has
vLLM imported already; helpers in tests/moefix.py).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.vllm import experts_cpu
from rollpatch.engines.vllm.layout import param_shape, placements
from rollpatch.engines.vllm.moe import expert_spec
from rollpatch.engines.vllm.tensorblocks import block_shape, extract
from rollpatch.errors import BaseMismatchError, EngineError, TargetMismatchError
from tests.moefix import HID, INTER, E, names


def test_bad_expert_layouts_are_refused() -> None:
    gate_up = [[names(e)["w1"], names(e)["w3"]] for e in range(E)]
    every = [list(range(E))] * 2
    with pytest.raises(EngineError, match="divide"):
        expert_spec("w13", gate_up, (INTER + 1, HID), every, expert_tp=2, dim=0)
    half = [[e if e < 4 else -1 for e in range(E)], [-1] * 4 + list(range(4))]
    with pytest.raises(EngineError, match="cover"):  # EP, but an expert on two ranks
        expert_spec("w13", gate_up, (INTER, HID), [list(range(E)), half[1]], expert_tp=1, dim=0)
    with pytest.raises(EngineError, match="slots"):
        expert_spec("w13", gate_up, (INTER, HID), [[0] * E, [0] * E], expert_tp=2, dim=0)
    with pytest.raises(EngineError, match="same tensors"):
        expert_spec("w13", gate_up[:-1] + [gate_up[0][:1]], (INTER, HID), every, expert_tp=2, dim=0)
    spec = expert_spec("w13", gate_up, (INTER, HID), half, expert_tp=1, dim=0)
    assert param_shape(spec, 2) == (4, 2 * INTER * HID)


@pytest.mark.parametrize(("ep", "dim"), [(False, 0), (False, 1), (True, 0)])
def test_expert_blocks_have_the_shape_every_rank_computes(ep: bool, dim: int) -> None:
    """``block_shape`` (what a rank receiving a gathered block allocates) is the shape of
    ``extract``'s block on the rank that holds it, for every expert placement: TP-split slots
    by rows and by columns, and EP (slots on one rank only, none on the other)."""
    if dim == 0:  # gate and up rows
        tensors, shape = [[names(e)["w1"], names(e)["w3"]] for e in range(E)], (INTER, HID)
    else:  # down columns
        tensors, shape = [[names(e)["w2"]] for e in range(E)], (HID, INTER)
    if ep:
        slots = [[e if e < E // 2 else -1 for e in range(E)], [-1] * (E // 2) + list(range(E // 2))]
    else:
        slots = [list(range(E))] * 2
    spec = expert_spec("w", tensors, shape, slots, expert_tp=1 if ep else 2, dim=dim)
    seen = 0
    for r in range(2):
        param = np.arange(np.prod(param_shape(spec, 2))).reshape(param_shape(spec, 2))
        for pl in placements(spec, r, 2):
            assert block_shape(pl) == extract(pl, param).shape, pl
            seen += 1
    assert seen == 2 * len(tensors[0]) * E


# -- the CPU kernel's packed experts (experts_cpu), offline: a stand-in prepack --------------


def _fake_prepack(weight: Any, isa: str) -> Any:
    """A per-expert re-layout like vLLM's (each expert's words reordered on their own)."""
    assert isa == "vec"
    return weight.flip(-1).contiguous()


@pytest.fixture
def packed_layer(monkeypatch: pytest.MonkeyPatch) -> Any:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(experts_cpu, "_prepack", _fake_prepack)
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    plain = {}
    for leaf, shape in (("w13_weight", (E, 2 * INTER, HID)), ("w2_weight", (E, HID, INTER))):
        plain[leaf] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        packed = torch.nn.Parameter(_fake_prepack(plain[leaf], "vec"), requires_grad=False)
        layer.register_parameter(leaf, packed)
    experts_cpu.keep(layer, plain, "vec")
    return layer


def _words(t: Any) -> np.ndarray:
    import torch

    return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)


def test_cpu_packed_experts_repack_only_touched_experts(packed_layer: Any) -> None:
    """prebuild packs only the touched experts (old words checked on a copy), install copies
    them in and reads them back; after the plain words are written the live layer equals a
    whole re-pack; a wrong old word or a failed read-back changes nothing served."""
    from rollpatch.engines.vllm.params import check_write

    layer, key = packed_layer, "m.w13_weight"
    assert experts_cpu.is_packed_experts(layer) and layer.__dict__["_rollpatch_kernel_only"]
    plain = experts_cpu.plain_of(layer, "w13_weight")
    per = 2 * INTER * HID
    prepared = np.array([1 * per + 5, 1 * per + 7, 3 * per, 4 * per + per - 1], np.int64)
    flat = _words(plain)
    old, new = flat[prepared].copy(), flat[prepared] ^ np.uint16(0x0101)
    before = _words(layer.w13_weight.data).copy()
    with pytest.raises(BaseMismatchError):  # a wrong old word: refused before anything served
        bad = old.copy()
        bad[0] ^= 1
        experts_cpu.prebuild(layer, "m", {key: (prepared, bad, new)}, None, check_write)
    built = experts_cpu.prebuild(layer, "m", {key: (prepared, old, new)}, None, check_write)
    idx, _ = built.slices["w13_weight"]
    assert idx.tolist() == [1, 3, 4] and "w2_weight" not in built.slices
    assert np.array_equal(flat[prepared], old)  # the plain words are not written yet
    experts_cpu.install(layer, "m", built)
    live = layer.w13_weight.data
    for e in range(E):
        changed = not np.array_equal(_words(live[e]), before.reshape(E, -1)[e])
        assert changed == (e in (1, 3, 4)), e
    flat[prepared] = new  # what the settler writes after the pause
    assert np.array_equal(_words(live), _words(_fake_prepack(plain, "vec")))
    # a read-back that fails: the layer is re-packed whole from its (unchanged) plain words
    flat[prepared] = old
    built = experts_cpu.prebuild(layer, "m", {key: (prepared, old, new)}, None, check_write)
    experts_cpu.repack_all(layer)
    orig = experts_cpu._same_bits
    try:
        experts_cpu._same_bits = lambda a, b: False  # type: ignore[assignment]
        with pytest.raises(TargetMismatchError):
            experts_cpu.install(layer, "m", built)
    finally:
        experts_cpu._same_bits = orig  # type: ignore[assignment]
    assert np.array_equal(_words(layer.w13_weight.data), before)
    # processed again (a reload that re-packs): the same plain tensors, refreshed in place
    fresh = {leaf: experts_cpu.plain_of(layer, leaf) + 1 for leaf in experts_cpu.LEAVES}
    experts_cpu.keep(layer, fresh, "vec")
    assert experts_cpu.plain_of(layer, "w13_weight") is plain
    assert np.array_equal(_words(plain), _words(fresh["w13_weight"]))


def test_cpu_packed_experts_refusal_is_clear() -> None:
    layer = types.SimpleNamespace()
    assert not experts_cpu.is_packed_experts(layer)
    assert "--worker-extension-cls" in experts_cpu.refusal(layer)
    layer.__dict__["_rollpatch_experts_refused"] = "the CPU kernel padded the intermediate size"
    assert "padded" in experts_cpu.refusal(layer)
