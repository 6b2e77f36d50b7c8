"""Mixture-of-experts routers stay BF16 under the default quantisation policy.

Quantised MoE checkpoints keep their routers unquantised (vLLM builds DeepSeek's and
Mixtral's gates without a quantisation config; the usual recipes ignore ``mlp.gate``), so the
served view must too, unless asked (``QuantPolicy(quantise_routers=True)``).
"""

from __future__ import annotations

import numpy as np
import pytest

from rollpatch.analysis.groups import tensor_group
from rollpatch.errors import ConfigError
from rollpatch.formats import QuantPolicy, cast_view
from rollpatch.formats.policy import is_router

ROUTERS = [
    "model.layers.3.mlp.gate.weight",  # Qwen2/3-MoE, DeepSeek, GLM, Kimi
    "model.layers.3.block_sparse_moe.gate.weight",  # Mixtral
    "model.layers.3.mlp.shared_expert_gate.weight",  # Qwen2-MoE
    "model.layers.3.mlp.router.weight",  # GPT-OSS
    "transformer.blocks.3.ffn.router.layer.weight",  # DBRX
]
NOT_ROUTERS = [
    "model.layers.3.mlp.gate_proj.weight",
    "model.layers.3.mlp.experts.5.gate_proj.weight",
    "model.layers.3.mlp.experts.gate_up_proj",
    "model.layers.3.self_attn.q_proj.weight",
    "model.layers.3.gate.weight",  # a "gate" not inside an MoE block
]


def test_router_names() -> None:
    assert all(is_router(n) for n in ROUTERS)
    assert not any(is_router(n) for n in NOT_ROUTERS)
    # one owner of the rule: the analyzer's "router" group is the policy's rule
    for n in ROUTERS + NOT_ROUTERS:
        assert (tensor_group(n) == "router") == is_router(n), n


def test_default_policy_keeps_routers_and_quantises_experts() -> None:
    p = QuantPolicy()
    for n in ROUTERS:
        assert not p.quantise(n, (64, 256)), n
    assert p.quantise("model.layers.3.mlp.experts.5.gate_proj.weight", (64, 256))
    assert p.quantise("model.layers.3.mlp.gate_proj.weight", (64, 256))
    # routers stay BF16 whatever include says, unless asked
    wide = QuantPolicy(include=("*.mlp.*",))
    assert not wide.quantise("model.layers.3.mlp.gate.weight", (64, 256))
    assert wide.quantise("model.layers.3.mlp.up_proj.weight", (64, 256))
    assert QuantPolicy(quantise_routers=True).quantise("model.layers.3.mlp.gate.weight", (8, 256))
    both = QuantPolicy(quantise_routers=True, exclude=("*.gate.weight",))
    assert not both.quantise("model.layers.3.mlp.gate.weight", (8, 256))  # exclude still wins
    with pytest.raises(ConfigError, match="quantise_routers"):
        QuantPolicy(quantise_routers="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["fp8-e4m3", "fp8-e4m3-block128", "nvfp4", "mxfp4", "int4-g128"])
def test_served_view_keeps_the_router_bf16(fmt: str) -> None:
    rng = np.random.default_rng(0)
    router, expert = "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.up_proj.weight"
    masters = {
        router: (0.02 * rng.standard_normal((8, 256))).astype(np.float32),
        expert: (0.02 * rng.standard_normal((64, 256))).astype(np.float32),
    }
    view = cast_view(masters, fmt)
    assert [n for n in view if n.startswith(router)] == [router] and view[router].dtype == "BF16"
    alone = cast_view({router: masters[router]}, "bf16")[router]
    assert np.array_equal(view[router].data, alone.data)
    quantised = sorted(n for n in view if n.startswith(expert))
    assert quantised != [expert] or view[expert].dtype != "BF16"  # the experts are quantised
    forced = cast_view(masters, fmt, policy=QuantPolicy(quantise_routers=True))
    assert sorted(n.replace(router, expert) for n in forced if n.startswith(router)) == quantised


@pytest.mark.parametrize("fmt", ["fp8-e4m3", "nvfp4"])
def test_patch_from_quantised_routers_to_the_new_default(fmt: str) -> None:
    """A view cast before the default changed (routers quantised) patches into one cast now:
    the router is written whole as BF16 and its quantised names are dropped, bit-exact."""
    from rollpatch.patch import DeltaOp, DropOp, FullOp, apply, decode, diff, encode

    rng = np.random.default_rng(1)
    router = "model.layers.0.mlp.gate.weight"
    masters = {
        router: (0.02 * rng.standard_normal((8, 256))).astype(np.float32),
        "model.layers.0.mlp.experts.0.up_proj.weight": (
            0.02 * rng.standard_normal((64, 256))
        ).astype(np.float32),
    }
    old = cast_view(masters, fmt, policy=QuantPolicy(quantise_routers=True))
    new = cast_view(masters, fmt)
    patch = diff(old, new)
    ops = {n: type(t.change) for n, t in patch.tensors.items()}
    assert ops[router] is FullOp and DeltaOp not in ops.values()
    assert {n for n, op in ops.items() if op is DropOp} == {n for n in old if n != router} - set(
        new
    )
    done = apply(old, decode(encode(patch, old), old), inplace=False)
    assert done.digest() == new.digest()
