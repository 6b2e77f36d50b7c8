"""What to simulate (:class:`SimConfig`) and the decoder shape it implies (:func:`llama_dims`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import check_fields, setting
from ..errors import ConfigError

if TYPE_CHECKING:
    from .moe import MoEConfig

__all__ = ["ModelDims", "SimConfig", "llama_dims"]


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """What to simulate. Every field is validated; see the module docstring for the model."""

    n_params: int = setting(50_000_000, lo=100_000, help="approximate parameter count")
    """Approximate parameter count; the decoder layout is sized to land near it."""
    seed: int = setting(0, lo=0, help="seed of every random draw")
    """Seed of every random draw (weights, gradients, tokens)."""
    lr: float = setting(3e-6, lo=0.0, lo_open=True, hi=1.0, hi_open=True, help="AdamW lr")
    """AdamW learning rate (RL post-training uses 1e-6 .. 1e-5)."""
    betas: tuple[float, float] = setting((0.9, 0.999), help="AdamW (beta1, beta2)")
    """AdamW (β1, β2)."""
    eps: float = setting(1e-8, lo=0.0, lo_open=True, hi=1.0, hi_open=True, help="AdamW eps")
    """AdamW epsilon."""
    weight_decay: float = setting(0.01, lo=0.0, hi=1.0, hi_open=True, help="weight decay")
    """Decoupled weight decay, applied to every tensor (torch's default single group)."""
    warm_steps: int = setting(1000, lo=0, help="Adam steps before the simulation starts")
    """Adam steps taken before the simulation starts (analytic warm state; 0 = cold)."""
    vocab: int | None = setting(None, lo=16, help="vocabulary size (None: 32000)")
    """Vocabulary size; None means 32000 (Llama-2 / TinyLlama)."""
    batch_tokens: int = setting(1 << 19, lo=1, help="tokens per training batch")
    """Tokens per training batch (decides which embedding rows get gradient)."""
    zipf_exponent: float = setting(
        1.1, lo=0.0, lo_open=True, hi=4.0, hi_open=True, help="Zipf-Mandelbrot exponent"
    )
    """Exponent of the Zipf-Mandelbrot token frequency law."""
    threads: int | None = setting(None, lo=1, help="worker threads (None: all cores)")
    """Worker threads (None: all cores). Results do not depend on it."""
    moe: MoEConfig | None = None
    """Experts (:class:`rollpatch.sim.moe.MoEConfig`); None: a dense model."""

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(f"SimConfig.{field} {why}", field=field, value=getattr(self, field))

        check_fields(self)
        if (
            not isinstance(self.betas, tuple)
            or len(self.betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)
        ):
            raise bad("betas", "must be a pair of floats in [0, 1)")
        from .moe import MoEConfig

        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise bad("moe", "must be None or a MoEConfig")


@dataclass(frozen=True)
class ModelDims:
    """The decoder shape chosen for a parameter budget (``experts`` 0: dense)."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    dense_layers: int = 0

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer`` has routed experts instead of a dense MLP."""
        return self.experts > 0 and layer >= self.dense_layers

    def layout(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint names → shapes, in Hugging Face Llama naming and order."""
        d, q, kv, ff = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, d)}
        for i in range(self.layers):
            pre = f"model.layers.{i}."
            out.update(
                {
                    pre + "self_attn.q_proj.weight": (q, d),
                    pre + "self_attn.k_proj.weight": (kv, d),
                    pre + "self_attn.v_proj.weight": (kv, d),
                    pre + "self_attn.o_proj.weight": (d, q),
                }
            )
            if self.is_moe(i):
                fe = self.expert_intermediate
                out[pre + "mlp.gate.weight"] = (self.experts, d)
                for e in range(self.experts):
                    ex = f"{pre}mlp.experts.{e}."
                    out[ex + "gate_proj.weight"] = (fe, d)
                    out[ex + "up_proj.weight"] = (fe, d)
                    out[ex + "down_proj.weight"] = (d, fe)
            else:
                out[pre + "mlp.gate_proj.weight"] = (ff, d)
                out[pre + "mlp.up_proj.weight"] = (ff, d)
                out[pre + "mlp.down_proj.weight"] = (d, ff)
            out[pre + "input_layernorm.weight"] = (d,)
            out[pre + "post_attention_layernorm.weight"] = (d,)
        out["model.norm.weight"] = (d,)
        out["lm_head.weight"] = (self.vocab, d)
        return out

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.layout().values())


def widths() -> Iterator[tuple[int, int, int, int, int]]:
    """The Llama-like widths a simulated model may take: ``(hidden, head_dim, heads,
    kv_heads, intermediate)``, hidden from 64 to 16384 (the shape searches pick among them)."""
    for d in range(64, 16385, 64):
        if d % (256 if d >= 1024 else 128 if d >= 512 else 64):
            continue
        hd = 64 if d <= 2048 else 128
        heads = d // hd
        kv = heads // 4 if heads % 4 == 0 and heads >= 8 else heads
        mult = 256 if d >= 1024 else 64
        yield d, hd, heads, kv, -(-(8 * d // 3) // mult) * mult


def aspect_cost(layers: int, hidden: int) -> float:
    """How far a depth is from TinyLlama's aspect (layers ≈ 0.5·√hidden), in log terms."""
    return abs(math.log(layers / (0.5 * math.sqrt(hidden))))


def llama_dims(n_params: int, vocab: int | None = None) -> ModelDims:
    """Pick a Llama-like shape near ``n_params`` (within a few %, aspect ratio of TinyLlama)."""
    v = vocab or 32000
    best: tuple[float, ModelDims] | None = None
    for d, hd, heads, kv, ff in widths():
        per_layer = 2 * d * d + 2 * d * kv * hd + 3 * d * ff + 2 * d
        layers = round((n_params - 2 * v * d - d) / per_layer)
        if layers < 1:
            continue
        dims = ModelDims(v, d, layers, ff, heads, kv, hd)
        size_err = abs(math.log((2 * v * d + d + layers * per_layer) / n_params))
        cost = 5 * size_err + aspect_cost(layers, d)
        if best is None or cost < best[0]:
            best = (cost, dims)
    if best is None:
        raise ValueError(f"SimConfig.n_params too small for vocab {v} (got {n_params!r})")
    return best[1]
