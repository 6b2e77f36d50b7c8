"""MoE expert tensors in vLLM's runtime coordinates: the arithmetic's refusals (offline).

The placements themselves are checked against vLLM's own ``RoutedExperts.weight_loader`` in
tests/test_moe_vllm_live.py (the loader runs inside the live MoE server's worker, which has
vLLM imported already; helpers in tests/moefix.py).
"""

from __future__ import annotations

import pytest

from rollpatch.engines.vllm.layout import param_shape
from rollpatch.engines.vllm.moe import expert_spec
from rollpatch.errors import EngineError
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
