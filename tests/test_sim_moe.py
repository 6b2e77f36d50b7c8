"""Mixture-of-experts in the AdamW simulator: naming, routing skew, dense layers unaffected."""

from __future__ import annotations

import math
import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from rollpatch.sim import AdamSim, SimConfig
from rollpatch.sim.moe import MoEConfig, expert_shares, moe_dims

E = 8
PARAMS = 6_000_000


def moe_cfg(shares: tuple[float, ...] | None = None, **kw: Any) -> SimConfig:
    moe = MoEConfig(experts=E, top_k=2, dense_layers=1, shares=shares)
    return SimConfig(n_params=PARAMS, vocab=1000, batch_tokens=4096, lr=3e-6, moe=moe, **kw)


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).view(np.uint16)


def _served_change(sim: AdamSim, steps: int) -> list[dict[str, float]]:
    """Per step, tensor → share of its BF16 values that changed."""
    prev = {k: _bf16(v) for k, v in sim.masters().items()}
    out = []
    for _ in range(steps):
        sim.step()
        cur = {k: _bf16(v) for k, v in sim.masters().items()}
        out.append({k: float(np.mean(cur[k] != prev[k])) for k in cur})
        prev = cur
    return out


def _expert_rate(rates: dict[str, float], layer: int, e: int) -> float:
    pre = f"model.layers.{layer}.mlp.experts.{e}."
    return float(np.mean([rates[pre + f"{t}_proj.weight"] for t in ("gate", "up", "down")]))


@pytest.mark.parametrize(
    "field,value",
    [
        ("experts", 1),
        ("top_k", 0),
        ("top_k", 9),
        ("expert_intermediate", 0),
        ("dense_layers", -1),
        ("zipf_exponent", -1.0),
        ("cold_fraction", 1.0),
        ("cold_factor", 0.0),
        ("shares", (1.0,) * 7),
        ("shares", (1.0,) * 7 + (-1.0,)),
        ("shares", (0.0,) * 8),
        ("shares", (1.0,) * 7 + (math.nan,)),
    ],
)
def test_moe_config_rejects_bad_fields_by_name(field: str, value: object) -> None:
    kw: dict[str, Any] = {"experts": 8, field: value} if field != "experts" else {field: value}
    if field == "experts":
        kw["top_k"] = 1
    with pytest.raises(ValueError, match=field):
        MoEConfig(**kw)
    with pytest.raises(ValueError, match="moe"):
        SimConfig(moe="qwen3")  # type: ignore[arg-type]


def test_layout_uses_qwen3_moe_names() -> None:
    sim = AdamSim(moe_cfg())
    d = sim.dims
    layout = sim.layout()
    assert d.experts == E and d.top_k == 2 and d.dense_layers == 1
    # layer 0 is dense, the others route to experts
    assert "model.layers.0.mlp.up_proj.weight" in layout
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in layout)
    for i in range(1, d.layers):
        pre = f"model.layers.{i}.mlp."
        assert layout[pre + "gate.weight"] == (E, d.hidden)
        assert pre + "up_proj.weight" not in layout
        for e in range(E):
            assert layout[f"{pre}experts.{e}.gate_proj.weight"] == (d.expert_intermediate, d.hidden)
            assert layout[f"{pre}experts.{e}.up_proj.weight"] == (d.expert_intermediate, d.hidden)
            assert layout[f"{pre}experts.{e}.down_proj.weight"] == (d.hidden, d.expert_intermediate)
    assert sim.n_params == d.n_params
    assert abs(math.log(sim.n_params / PARAMS)) < 0.1
    # memory stays 12 bytes per parameter: FP32 masters, m and v, nothing per expert beyond
    held = sum(p.w.nbytes + p.m.nbytes + p.v.nbytes for p in sim._params.values())
    assert held == 12 * sim.n_params


@pytest.mark.parametrize("n,experts,top_k", [(1_000_000_000, 32, 4), (2_000_000_000, 64, 8)])
def test_moe_dims_near_target(n: int, experts: int, top_k: int) -> None:
    d = moe_dims(n, None, MoEConfig(experts=experts, top_k=top_k))
    assert abs(math.log(d.n_params / n)) < 0.05
    assert d.experts == experts and d.expert_intermediate % 64 == 0
    names = d.layout()
    pat = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    expert_params = sum(math.prod(s) for k, s in names.items() if pat.fullmatch(k))
    assert expert_params > 0.8 * d.n_params  # experts dominate, as in real MoE checkpoints


def test_routing_law_is_skewed_seeded_and_overridable() -> None:
    moe = MoEConfig(experts=32, top_k=4)
    p = expert_shares(moe, 3, seed=0)
    assert p.shape == (32,) and abs(p.sum() - 1) < 1e-12 and (p > 0).all()
    assert p.max() / p.min() > 1e4  # Zipf times the cold experts
    assert np.array_equal(p, expert_shares(moe, 3, seed=0))
    assert not np.array_equal(p, expert_shares(moe, 4, seed=0))  # shuffled per layer
    flat = expert_shares(MoEConfig(experts=32, zipf_exponent=0, cold_fraction=0), 3, seed=0)
    assert np.allclose(flat, 1 / 32)
    measured = expert_shares(MoEConfig(experts=4, top_k=1, shares=(3, 1, 0, 4)), 0, seed=0)
    assert measured.tolist() == [3 / 8, 1 / 8, 0, 4 / 8]


def test_expert_counts_drive_the_expert_gradient() -> None:
    sim = AdamSim(moe_cfg(threads=1))
    load = sim.expert_load(1)
    assert load.sum() == pytest.approx(4096 * 2)
    with pytest.raises(ValueError, match="no routed experts"):
        sim.expert_load(0)
    counts = np.stack([sim.expert_counts(1, t) for t in range(1, 41)])
    assert np.array_equal(counts[0], sim.expert_counts(1, 1))  # deterministic
    # Poisson counts around the expected load
    assert np.allclose(counts.mean(axis=0), load, rtol=0.25, atol=3)
    t = next(t for t in range(1, 41) if (counts[t - 1] == 0).any())
    for e in range(E):
        grads = [
            sim.gradient(f"model.layers.1.mlp.experts.{e}.{k}_proj.weight", t)
            for k in ("gate", "up", "down")
        ]
        touched = {bool(np.any(g)) for g in grads}
        assert touched == {bool(counts[t - 1, e])}  # one count for the expert's three tensors
    router = sim.gradient("model.layers.1.mlp.gate.weight", t)
    assert np.all(np.any(router != 0, axis=1))  # the router gets gradient every step


def test_skew_is_visible_in_per_expert_change_rates() -> None:
    # expert 0 is never routed, experts 1-2 rarely (0.2 assignments per step), the rest hot
    shares = (0.0, 0.2, 0.2) + (1000.0,) * (E - 3)
    skewed = _served_change(AdamSim(moe_cfg(shares)), 3)
    uniform = _served_change(AdamSim(moe_cfg((1.0,) * E)), 3)
    for rates_s, rates_u in zip(skewed, uniform):
        u = [_expert_rate(rates_u, 1, e) for e in range(E)]
        s = [_expert_rate(rates_s, 1, e) for e in range(E)]
        assert max(u) / min(u) < 1.5  # balanced routing: experts change alike
        hot = float(np.median(s[3:]))
        assert hot > 0.005
        assert s[0] < hot / 50  # never routed: only weight decay moves it, inside rounding
        assert max(s) / max(min(s), 1e-9) > 20
        # a hot expert changes like the dense MLP of layer 0 (same optimizer, same law)
        dense = np.mean(
            [rates_s[f"model.layers.0.mlp.{k}_proj.weight"] for k in ("gate", "up", "down")]
        )
        assert 0.3 < hot / dense < 3
        assert rates_s["model.layers.1.mlp.gate.weight"] > 0  # router moves every step


def test_rare_expert_changes_in_bursts_when_routed() -> None:
    # one rarely routed expert (0.06 assignments per step): between the steps that reach it,
    # its momentum decays and few of its values move; on such a step Adam's normalised update
    # is larger than a hot expert's (its v saw few tokens), and it decays by β1 afterwards
    shares = (0.05,) + (1000.0,) * (E - 1)
    sim = AdamSim(moe_cfg(shares))
    steps = 12
    rates = _served_change(sim, steps)
    counts = [int(sim.expert_counts(1, t)[0]) for t in range(1, steps + 1)]
    rare = [_expert_rate(r, 1, 0) for r in rates]
    hot = [float(np.median([_expert_rate(r, 1, e) for e in range(1, E)])) for r in rates]
    routed = [i for i, c in enumerate(counts) if c]
    assert routed and routed[0] > 0, counts  # seed 0 reaches it at step 9 of 12
    first = routed[0]
    assert all(rare[i] < hot[i] / 5 for i in range(first))  # quiet: few, small updates
    assert rare[first] > hot[first]  # the burst
    assert all(rare[i] > 5 * max(rare[:first]) for i in range(first, steps))  # decays slowly


def test_dense_tensors_do_not_depend_on_routing() -> None:
    a = AdamSim(moe_cfg((1.0,) * E))
    b = AdamSim(moe_cfg((0.0, 0.2) + (1000.0,) * (E - 2)))
    for _ in range(2):
        a.step()
        b.step()
    ma, mb = a.masters(), b.masters()
    experts = [n for n in ma if ".mlp.experts." in n]
    assert experts
    differs = [n for n in experts if not np.array_equal(ma[n], mb[n])]
    assert differs  # routing changed the experts...
    for n in ma:
        if ".mlp.experts." not in n:
            assert np.array_equal(ma[n], mb[n]), n  # ...and nothing else, router included


def test_moe_deterministic_and_independent_of_threads() -> None:
    a = AdamSim(moe_cfg(threads=1))
    b = AdamSim(moe_cfg(threads=3))
    a.step()
    b.step()
    ma, mb = a.masters(), b.masters()
    assert all(np.array_equal(ma[n], mb[n]) for n in ma)
    m1, v1 = a.adam_state("model.layers.1.mlp.experts.3.up_proj.weight")
    m2, v2 = b.adam_state("model.layers.1.mlp.experts.3.up_proj.weight")
    assert np.array_equal(m1, m2) and np.array_equal(v1, v2)
