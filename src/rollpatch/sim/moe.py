"""Mixture-of-experts in the simulator: :class:`MoEConfig`, the routing law and the MoE shape.

**Layout.** Qwen3-MoE naming: every layer from ``dense_layers`` on replaces its MLP by a router
``model.layers.N.mlp.gate.weight`` (experts × hidden) and ``experts`` SwiGLU experts
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` of width ``expert_intermediate``
(default 3/8 of hidden rounded to 64: Qwen3-30B-A3B has 768 for hidden 2048). The first
``dense_layers`` layers keep a dense MLP (DeepSeek's ``first_k_dense_replace``).

**Routing.** Each MoE layer sends ``batch_tokens · top_k`` token-expert assignments per step.
Expert ``e`` gets a share ``p_e``: a Zipf law ``(rank + 1)^-zipf_exponent`` over the experts,
with ranks shuffled per layer (an expert's index says nothing about its load), and a
``cold_fraction`` of the experts "specialised elsewhere" at ``cold_factor`` of their Zipf share
(the RL task's domain rarely reaches them; the same device as the token model's
out-of-domain vocabulary). ``shares`` replaces the law by a measured load (for instance counted
from ``routed_experts`` replay data), the same for every layer. The count of one step is
Poisson(``p_e · batch_tokens · top_k``); all three tensors of an expert see the same count.
These constants are assumptions, not a fit to a measured model: with load-balancing losses
real loads are flatter, domain-specialised RL data makes them steeper.

**Gradients.** An expert's gradient is its tensor's synthetic gradient scaled by
``√count`` (noise-dominated sums, as for embedding rows); a step that routes no token to the
expert gives it no gradient, and AdamW still moves it by momentum (one dense optimizer, as in
torch). Its warm Adam state samples which of the last steps routed tokens to it. So an expert
with many tokens per step updates like a dense MLP; a rarely routed one gets a large update on
the steps that reach it and decaying, mostly absorbed ones in between. The router gets a dense
gradient every step (the softmax over all experts touches every row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import check_fields, setting
from ..errors import ConfigError
from .config import ModelDims, aspect_cost, widths

__all__ = ["MoEConfig", "expert_shares", "moe_dims"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Experts of a simulated MoE model. Every field is validated; see the module docstring."""

    experts: int = setting(32, lo=2, hi=4096, help="routed experts per MoE layer")
    """Routed experts per MoE layer."""
    top_k: int = setting(4, lo=1, help="experts per token (at most experts)")
    """Experts per token."""
    expert_intermediate: int | None = setting(None, lo=1, help="width of one expert's MLP")
    """Width of one expert's MLP; None: 3/8 of hidden, rounded up to 64."""
    dense_layers: int = setting(0, lo=0, help="the first layers that keep a dense MLP")
    """The first layers that keep a dense MLP (0: every layer is MoE, as in Qwen3-MoE)."""
    zipf_exponent: float = setting(1.0, lo=0.0, hi=4.0, hi_open=True, help="Zipf exponent")
    """Exponent of the per-layer Zipf law of tokens per expert (0: uniform)."""
    cold_fraction: float = setting(0.25, lo=0.0, hi=1.0, hi_open=True, help="cold experts")
    """Share of experts that the RL data rarely reaches."""
    cold_factor: float = setting(
        1e-5, lo=0.0, lo_open=True, hi=1.0, help="the cold experts' relative load"
    )
    """Their load relative to the Zipf law."""
    shares: tuple[float, ...] | None = setting(None, help="a measured load per expert")
    """A measured load per expert (any positive scale), used for every layer instead of the law."""

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(f"MoEConfig.{field} {why}", field=field, value=getattr(self, field))

        check_fields(self)
        if self.top_k > self.experts:
            raise bad("top_k", "must be an int in [1, experts]")
        if self.shares is not None:
            ok = (
                isinstance(self.shares, tuple)
                and len(self.shares) == self.experts
                and all(
                    isinstance(s, (int, float)) and math.isfinite(s) and s >= 0 for s in self.shares
                )
                and sum(self.shares) > 0
            )
            if not ok:
                raise bad("shares", "must be None or a tuple of `experts` finite loads >= 0")


def expert_shares(moe: MoEConfig, layer: int, seed: int) -> np.ndarray:
    """Share of one MoE layer's token-expert assignments per expert (float64, sums to 1)."""
    if moe.shares is not None:
        loads = np.asarray(moe.shares, dtype=np.float64)
        return loads / loads.sum()
    ss = np.random.SeedSequence(seed, spawn_key=(0, 8, layer))
    rng = np.random.Generator(np.random.PCG64(ss))
    p = (np.arange(moe.experts) + 1.0) ** -float(moe.zipf_exponent)
    cold = rng.permutation(moe.experts)[: round(moe.cold_fraction * moe.experts)]
    p[np.sort(cold)] *= moe.cold_factor
    p = np.asarray(p[rng.permutation(moe.experts)], dtype=np.float64)
    return p / p.sum()


def _expert_width(moe: MoEConfig, hidden: int) -> int:
    if moe.expert_intermediate is not None:
        return moe.expert_intermediate
    return -(-(3 * hidden // 8) // 64) * 64


def moe_dims(n_params: int, vocab: int | None, moe: MoEConfig) -> ModelDims:
    """An MoE shape near ``n_params`` total parameters (attention as :func:`llama_dims`)."""
    v = vocab or 32000
    best: tuple[float, ModelDims] | None = None
    for d, hd, heads, kv, ff in widths():
        fe = _expert_width(moe, d)
        attn = 2 * d * d + 2 * d * kv * hd + 2 * d
        dense_layer = attn + 3 * d * ff
        moe_layer = attn + moe.experts * (3 * d * fe + d)
        k = moe.dense_layers
        moe_count = round((n_params - 2 * v * d - d - k * dense_layer) / moe_layer)
        if moe_count < 1:
            continue
        layers = k + moe_count
        total = 2 * v * d + d + k * dense_layer + moe_count * moe_layer
        dims = ModelDims(
            v,
            d,
            layers,
            ff,
            heads,
            kv,
            hd,
            experts=moe.experts,
            top_k=moe.top_k,
            expert_intermediate=fe,
            dense_layers=k,
        )
        cost = 5 * abs(math.log(total / n_params)) + aspect_cost(layers, d)
        if best is None or cost < best[0]:
            best = (cost, dims)
    if best is None:
        raise ValueError(
            f"SimConfig.n_params too small for vocab {v} and {moe.experts} experts "
            f"(got {n_params!r})"
        )
    return best[1]
