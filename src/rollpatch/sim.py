"""Synthetic RL training: consecutive FP32 master versions as AdamW makes them, at any size.

Every compression number rollpatch publishes is measured on versions from this module, so the
choices below are the ones a reviewer should check. Nothing here is fitted to a particular
checkpoint; the constants are round numbers typical of public 0.1B-7B Llama-family models.

**Layout.** A Llama-style decoder (RMSNorm, GQA attention, SwiGLU MLP, untied ``lm_head``)
sized to hit ``n_params``: depth follows the TinyLlama / Llama-2 aspect ratio
(layers ≈ 0.5·√hidden), ``intermediate ≈ 8/3·hidden`` rounded as Llama does, head_dim 64
(128 above hidden 2048), kv heads = heads/4, vocabulary 32000 unless given. 1B → hidden
1792, 26 layers, ff 4864, 28 heads / 7 kv heads (1.003B).

**Weights.** Linear weights are ``σ_t · a_i · b_j · z`` with ``σ_t`` per role (q/k ~0.025-0.03
and larger in early layers, v/o ~0.012, MLP ~0.016-0.02, embeddings ~0.018, lm_head 0.02)
times a per-tensor lognormal(0, 0.15); row and column scales ``a, b`` lognormal (0.2, 0.25);
``z`` a standard normal pushed to heavier tails (``z + 0.03·z³``, kurtosis ≈ 3.9 before the
row/column mixing). Norm weights are ``μ_t · exp(0.1·z)``, ``μ_t`` lognormal(0, 0.15)
around 1. All per-element draws (weights, warm state, gradient noise) go through 65,536-entry
quantile tables indexed by uniform 16-bit integers: 4-8x faster than numpy's normal sampler,
and the products with continuous row/column scales hide the quantisation.

**Gradients** (fresh every step, generated per tensor and per chunk, never materialised for
the whole model)::

    g_ij = s_t · ρ_i · γ_j · (ε_ij + P_ij + L_t,ij)

``s_t``: per-tensor scale with step-to-step lognormal(0, 0.2) jitter; ``ρ_i`` per-row
lognormal(0, 0.4); ``γ_j`` per input channel: tensors reading the residual stream share one
hidden-channel profile (lognormal(0, 0.3) plus 0.5% outlier channels ×3-6, like the massive
activations of real LLMs); ``ε``: i.i.d. heavy-tailed unit noise (``q + 0.1·q³``, kurtosis
≈ 6.6, tails cut at ≈ 10σ by the table); ``P``: a persistent rank-2 direction with RMS
0.15 (what gives ``m`` a mean, i.e. consistent progress); ``L_t``: a fresh rank-4 component
with RMS 0.5 (batch structure). The noise dominates, as it does at RL batch sizes, so
``|update|/lr`` has RMS ≈ 0.25 (pure noise would give √((1-β1)/(1+β1)) ≈ 0.23).

**Calibration.** The one public anchor is the share of BF16 values that change per step:
PULSE reports ~1% at RL learning rates for 0.5B-7B models. This model gives ~1.2% at
lr 1e-6, ~3% at 3e-6 and ~8% at 1e-5 (100M-1B sizes); the share grows about linearly with
lr and falls with |w| (halving per binade), as rounding arithmetic says it must.

**Embedding rows are touched sparsely.** Each step draws a batch of ``batch_tokens`` tokens
from a Zipf-Mandelbrot law (exponent 1.1, 30% of the vocabulary "out of domain" at 1e-3 of
its frequency, frequency rank correlated with token id as in BPE vocabularies); row ``i``
gets gradient only if its token occurs, scaled by √count. Untouched rows still move by
momentum, as under real AdamW with a dense optimizer. ``lm_head`` gets dense gradient
(the softmax touches every row).

**Adam state is pre-warmed analytically** so that step 1 of the simulator is step
``warm_steps + 1`` of a run in its stationary regime, with the bias corrections torch would
use at that step: ``m`` is the EMA's stationary law (mean ``(1-β1^T)·E[g]``, Gaussian noise of
variance ``(1-β1)/(1+β1)·Var[g]``), ``v = (1-β2^T)·E[g²]`` times a chi-square-like jitter of
the right size for the EMA's effective sample count. The last 64 steps are sampled
explicitly per tensor (its gradient-scale jitter) and, for embedding rows, per row (which
steps touched the token: a rare token touched now gets the large Adam update it gets in
reality); older touches enter as a Binomial count with a Gamma-distributed weight sum, so a
token never seen has ``m = v = 0``. ``warm_steps=0`` gives a cold start (``m = v = 0``) instead.

**Arithmetic** is torch's single-tensor AdamW, in float32, in place, in chunks of at most
4 Mi elements (16 MiB): ``w *= 1-lr·wd; m += (1-β1)(g-m); v = β2·v + ((1-β2)·g)·g;
w += (-lr/bc1)·m / (√v/√bc2 + eps)``. It matches ``torch.optim.AdamW`` to float32 rounding
(bitwise on most elements; torch fuses its ``lerp`` with an FMA, numpy cannot).

**Determinism.** Every random draw comes from a PCG64 generator seeded by
``(seed, tensor, purpose, step, chunk)``, with chunk boundaries fixed by the tensor's shape,
so results do not depend on the thread count or on the order tensors are processed in.
They are bitwise reproducible on one numpy/BLAS build; other CPUs may differ in the last bit
of the low-rank products and of ``exp``.

Memory is the 12 bytes/parameter of FP32 ``w, m, v`` plus a few chunk temporaries per thread.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

import numpy as np

__all__ = ["AdamSim", "ModelDims", "SimConfig", "llama_dims", "simulate"]

_F32 = np.float32
CHUNK_ELEMS = 1 << 22  # elements per work unit: 16 MiB of float32
_RANK_P, _ALPHA_P = 2, 0.15  # persistent low-rank direction
_RANK_T, _ALPHA_T = 4, 0.5  # fresh low-rank batch structure
_SIGMA_S = 0.2  # step-to-step jitter of a tensor's gradient scale
_WARM_WINDOW = 64  # embedding touches sampled explicitly for the warm state
_ROLE_SIGMA = {
    "q": 0.025,
    "k": 0.03,
    "v": 0.012,
    "o": 0.012,
    "gate": 0.02,
    "up": 0.018,
    "down": 0.016,
    "embed": 0.018,
    "lm_head": 0.02,
}


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """What to simulate. Every field is validated; see the module docstring for the model."""

    n_params: int = 50_000_000
    """Approximate parameter count; the decoder layout is sized to land near it."""
    seed: int = 0
    """Seed of every random draw (weights, gradients, tokens)."""
    lr: float = 3e-6
    """AdamW learning rate (RL post-training uses 1e-6 .. 1e-5)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (β1, β2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay, applied to every tensor (torch's default single group)."""
    warm_steps: int = 1000
    """Adam steps taken before the simulation starts (analytic warm state; 0 = cold)."""
    vocab: int | None = None
    """Vocabulary size; None means 32000 (Llama-2 / TinyLlama)."""
    batch_tokens: int = 1 << 19
    """Tokens per training batch (decides which embedding rows get gradient)."""
    zipf_exponent: float = 1.1
    """Exponent of the Zipf-Mandelbrot token frequency law."""
    threads: int | None = None
    """Worker threads (None: all cores). Results do not depend on it."""

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SimConfig.{field} {why} (got {getattr(self, field)!r})")

        if not isinstance(self.n_params, int) or self.n_params < 100_000:
            raise bad("n_params", "must be an int >= 100_000")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise bad("seed", "must be a non-negative int")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise bad("lr", "must be in (0, 1)")
        if (
            not isinstance(self.betas, tuple)
            or len(self.betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)
        ):
            raise bad("betas", "must be a pair of floats in [0, 1)")
        if not (isinstance(self.eps, (int, float)) and 0 < self.eps < 1):
            raise bad("eps", "must be in (0, 1)")
        if not (isinstance(self.weight_decay, (int, float)) and 0 <= self.weight_decay < 1):
            raise bad("weight_decay", "must be in [0, 1)")
        if not isinstance(self.warm_steps, int) or self.warm_steps < 0:
            raise bad("warm_steps", "must be a non-negative int")
        if self.vocab is not None and (not isinstance(self.vocab, int) or self.vocab < 16):
            raise bad("vocab", "must be None or an int >= 16")
        if not isinstance(self.batch_tokens, int) or self.batch_tokens < 1:
            raise bad("batch_tokens", "must be a positive int")
        if not (isinstance(self.zipf_exponent, (int, float)) and 0 < self.zipf_exponent < 4):
            raise bad("zipf_exponent", "must be in (0, 4)")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise bad("threads", "must be None or a positive int")


@dataclass(frozen=True)
class ModelDims:
    """The decoder shape chosen for a parameter budget."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

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
                    pre + "mlp.gate_proj.weight": (ff, d),
                    pre + "mlp.up_proj.weight": (ff, d),
                    pre + "mlp.down_proj.weight": (d, ff),
                    pre + "input_layernorm.weight": (d,),
                    pre + "post_attention_layernorm.weight": (d,),
                }
            )
        out["model.norm.weight"] = (d,)
        out["lm_head.weight"] = (self.vocab, d)
        return out

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.layout().values())


def llama_dims(n_params: int, vocab: int | None = None) -> ModelDims:
    """Pick a Llama-like shape near ``n_params`` (within a few %, aspect ratio of TinyLlama)."""
    v = vocab or 32000
    best: tuple[float, ModelDims] | None = None
    for d in range(64, 16385, 64):
        if d % (256 if d >= 1024 else 128 if d >= 512 else 64):
            continue
        hd = 64 if d <= 2048 else 128
        heads = d // hd
        kv = heads // 4 if heads % 4 == 0 and heads >= 8 else heads
        mult = 256 if d >= 1024 else 64
        ff = -(-(8 * d // 3) // mult) * mult
        per_layer = 2 * d * d + 2 * d * kv * hd + 3 * d * ff + 2 * d
        layers = round((n_params - 2 * v * d - d) / per_layer)
        if layers < 1:
            continue
        dims = ModelDims(v, d, layers, ff, heads, kv, hd)
        size_err = abs(math.log((2 * v * d + d + layers * per_layer) / n_params))
        cost = 5 * size_err + abs(math.log(layers / (0.5 * math.sqrt(d))))
        if best is None or cost < best[0]:
            best = (cost, dims)
    if best is None:
        raise ValueError(f"SimConfig.n_params too small for vocab {v} (got {n_params!r})")
    return best[1]


@cache
def _quantile_tables() -> dict[str, np.ndarray]:
    """Unit-variance float32 tables of 65,536 midpoint quantiles, indexed by uniform uint16.

    ``gauss``: N(0, 1); ``gauss_sq``: its square; ``grad``: ``q + 0.1·q³`` (gradient noise);
    ``weight``: ``q + 0.03·q³`` (weights).
    """
    nd = statistics.NormalDist()
    q = np.array([nd.inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float64)
    q /= q.std()
    unit = lambda x: (x / x.std()).astype(_F32)
    return {
        "gauss": q.astype(_F32),
        "gauss_sq": (q * q).astype(_F32),
        "grad": unit(q + 0.1 * q**3),
        "weight": unit(q + 0.03 * q**3),
    }


def _draw(rng: np.random.Generator, table: str, shape: tuple[int, ...]) -> np.ndarray:
    return _quantile_tables()[table][rng.integers(0, 65536, size=shape, dtype=np.uint16)]


def _tensor_id(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def _role(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "embed"
    if name == "lm_head.weight":
        return "lm_head"
    if name.endswith("norm.weight"):
        return "norm"
    return name.rsplit(".", 2)[-2].split("_")[0]  # q, k, v, o, gate, up, down


class _Param:
    """One tensor: FP32 master, Adam moments, and the static parts of its gradient model."""

    def __init__(self, name: str, shape: tuple[int, ...], layer: int) -> None:
        self.name, self.shape, self.layer = name, shape, layer
        self.role = _role(name)
        self.tid = _tensor_id(name)
        self.rows, self.cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        step = max(1, CHUNK_ELEMS // self.cols)
        self.chunks = [(r, min(r + step, self.rows)) for r in range(0, self.rows, step)]
        self.w = np.empty((self.rows, self.cols), _F32)
        self.m = np.empty_like(self.w)
        self.v = np.empty_like(self.w)
        self.g_scale = 1.0
        self.row = np.ones(self.rows, _F32)  # gradient row scale ρ
        self.col = np.ones(self.cols, _F32)  # gradient column scale γ
        self.u0 = np.zeros((self.rows, _RANK_P), _F32)  # persistent direction, α_p folded in
        self.v0 = np.zeros((self.cols, _RANK_P), _F32)
        self.sparse = self.role == "embed"
        self.w_mu = 1.0  # weight scale σ (norms: mean μ)
        self.w_row = self.w_col = self.row  # weight row/column scales (init only)
        self.warm: tuple[np.ndarray, ...] = ()  # per-row warm-state coefficients


class AdamSim:
    """Consecutive FP32 master versions of a Llama-like model under AdamW (see module doc).

    ``masters()`` returns views into the live state; ``step()`` advances it in place.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.dims = llama_dims(config.n_params, config.vocab)
        self.step_count = 0
        self._threads = config.threads or os.cpu_count() or 1
        self._params: dict[str, _Param] = {}
        for name, shape in self.dims.layout().items():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            self._params[name] = _Param(name, shape, layer)
        _quantile_tables()
        self._token_model()
        hidden = self._hidden_profile()
        for p in self._params.values():
            self._static(p, hidden)
        self._run(self._init_chunk)
        for p in self._params.values():
            p.w_row = p.w_col = p.row

    # -- public API ---------------------------------------------------------------------------

    def layout(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint names → shapes."""
        return {n: p.shape for n, p in self._params.items()}

    @property
    def n_params(self) -> int:
        return sum(p.w.size for p in self._params.values())

    def masters(self) -> dict[str, np.ndarray]:
        """Current FP32 masters, in their checkpoint shapes (views: do not mutate)."""
        return {n: p.w.reshape(p.shape) for n, p in self._params.items()}

    def adam_state(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(exp_avg, exp_avg_sq)`` of one tensor (views: do not mutate)."""
        p = self._params[name]
        return p.m.reshape(p.shape), p.v.reshape(p.shape)

    def gradient(self, name: str, step: int) -> np.ndarray:
        """The synthetic gradient of one tensor at simulator step ``step`` (>= 1), in full."""
        if step < 1:
            raise ValueError(f"step must be >= 1 (got {step!r})")
        p = self._params[name]
        ctx = self._step_context(step, [p])
        out = np.empty((p.rows, p.cols), _F32)
        for ci, (r0, r1) in enumerate(p.chunks):
            out[r0:r1] = self._grad_chunk(p, step, ci, r0, r1, ctx)
        return out.reshape(p.shape)

    def step(self, grads: Mapping[str, np.ndarray] | None = None) -> None:
        """One AdamW step on every tensor, in place.

        ``grads`` may supply the gradient of some tensors (any float array of the tensor's
        shape); the others get their synthetic gradient.
        """
        grads = dict(grads or {})
        for name, g in grads.items():
            if name not in self._params:
                raise ValueError(f"grads names an unknown tensor {name!r}")
            if tuple(np.shape(g)) != self._params[name].shape:
                raise ValueError(
                    f"gradient for {name!r} has shape {np.shape(g)}, "
                    f"expected {self._params[name].shape}"
                )
        t = self.step_count + 1
        cfg = self.config
        b1, b2 = cfg.betas
        n = cfg.warm_steps + t
        bc1, bc2 = 1 - b1**n, 1 - b2**n
        scal = (
            _F32(1 - cfg.lr * cfg.weight_decay),
            _F32(1 - b1),
            _F32(b2),
            _F32(1 - b2),
            _F32(bc2**0.5),
            _F32(cfg.eps),
            _F32(-(cfg.lr / bc1)),
        )
        synth = [p for n_, p in self._params.items() if n_ not in grads]
        ctx = self._step_context(t, synth)
        flat = {
            k: np.asarray(g, dtype=_F32).reshape(self._params[k].rows, -1) for k, g in grads.items()
        }

        def work(p: _Param, ci: int, r0: int, r1: int) -> None:
            g = (
                flat[p.name][r0:r1].copy()
                if p.name in flat
                else self._grad_chunk(p, t, ci, r0, r1, ctx)
            )
            _adamw(p.w[r0:r1], p.m[r0:r1], p.v[r0:r1], g, scal)

        self._run(work)
        self.step_count = t

    # -- model construction ---------------------------------------------------------------------

    def _rng(self, tid: int, purpose: int, step: int = 0, chunk: int = 0) -> np.random.Generator:
        ss = np.random.SeedSequence(self.config.seed, spawn_key=(tid, purpose, step, chunk))
        return np.random.Generator(np.random.PCG64(ss))

    def _run(self, fn: Callable[[_Param, int, int, int], None]) -> None:
        tasks = [
            (p, ci, r0, r1) for p in self._params.values() for ci, (r0, r1) in enumerate(p.chunks)
        ]
        tasks.sort(key=lambda t: -(t[3] - t[2]) * t[0].cols)  # big first: better balance
        if self._threads == 1:
            for task in tasks:
                fn(*task)
            return
        with ThreadPoolExecutor(self._threads) as ex:
            for _ in ex.map(lambda a: fn(*a), tasks):
                pass

    def _token_model(self) -> None:
        """Per-token expected count per batch (Zipf-Mandelbrot, BPE-like id order)."""
        v = self.dims.vocab
        rng = self._rng(0, 1)
        key = np.log1p(np.arange(v)) + rng.standard_normal(v)
        rank = np.empty(v, np.int64)
        rank[np.argsort(key, kind="stable")] = np.arange(v)
        freq = (rank + 2.7) ** -self.config.zipf_exponent
        freq[rng.random(v) < 0.3] *= 1e-3
        self._lam = freq / freq.sum() * self.config.batch_tokens  # E[count] per step

    def _hidden_profile(self) -> np.ndarray:
        d = self.dims.hidden
        rng = self._rng(0, 2)
        h = np.exp(0.3 * rng.standard_normal(d))
        out = rng.random(d) < 0.005
        h[out] *= rng.uniform(3, 6, out.sum())
        return h / np.sqrt(np.mean(h**2))

    def _static(self, p: _Param, hidden: np.ndarray) -> None:
        rng = self._rng(p.tid, 3)
        p.g_scale = float(1e-5 * np.exp(0.5 * rng.standard_normal()))
        if p.role == "norm":
            p.col = np.exp(0.3 * rng.standard_normal(p.cols)).astype(_F32)
        else:
            p.row = np.exp(0.4 * rng.standard_normal(p.rows)).astype(_F32)
            reads_hidden = p.cols == self.dims.hidden and p.role != "o"
            base = hidden if reads_hidden else np.exp(0.4 * rng.standard_normal(p.cols))
            p.col = (base * np.exp(0.1 * rng.standard_normal(p.cols))).astype(_F32)
        p.u0 = (rng.standard_normal((p.rows, _RANK_P)) * (_ALPHA_P / math.sqrt(_RANK_P))).astype(
            _F32
        )
        p.v0 = rng.standard_normal((p.cols, _RANK_P)).astype(_F32)
        if p.role == "norm":
            p.w_mu = float(np.exp(0.15 * rng.standard_normal()))
        else:
            depth = (p.layer / self.dims.layers) if p.layer >= 0 else 0.5
            boost = 1.5 - 0.5 * depth if p.role in ("q", "k") else 1.0
            p.w_mu = float(_ROLE_SIGMA[p.role] * boost * np.exp(0.15 * rng.standard_normal()))
            p.w_row = np.exp(0.2 * rng.standard_normal(p.rows)).astype(_F32)
            p.w_col = np.exp(0.25 * rng.standard_normal(p.cols)).astype(_F32)
        p.warm = self._warm_coefficients(p, rng)

    def _warm_coefficients(self, p: _Param, rng: np.random.Generator) -> tuple:
        """Per-row coefficients of the Adam state after ``warm_steps`` steps.

        In units of one touch's E[g] (mean, ``mb``) and E[g²] (``mc`` for m's noise, ``vb``
        for v): the last ``_WARM_WINDOW`` steps are sampled explicitly (touches and the
        tensor's scale jitter), older touches as a Binomial count with Gamma-distributed
        weight sum. Dense tensors are the case "every row touched every step".
        """
        b1, b2 = self.config.betas
        big_t = self.config.warm_steps
        k = min(_WARM_WINDOW, big_t)
        ages = np.arange(k)
        s = np.exp(_SIGMA_S * rng.standard_normal(k) - _SIGMA_S**2 / 2)
        if p.sparse:
            prob = -np.expm1(-self._lam)
            touch = rng.random((p.rows, k)) < prob[:, None]
            count_scale = self._lam / np.maximum(prob, 1e-30)
        else:
            prob = np.ones(p.rows)
            touch = np.ones((p.rows, k), bool)
            count_scale = np.ones(p.rows)
        mb = touch @ ((1 - b1) * b1**ages * s)
        mc = touch @ ((1 - b1) ** 2 * b1 ** (2 * ages) * s**2)
        vb = touch @ ((1 - b2) * b2**ages * s**2)
        n_old = rng.binomial(big_t - k, prob) if big_t > k else np.zeros(p.rows, np.int64)
        if big_t > k:
            w = (1 - b2) * b2 ** np.arange(k, big_t, dtype=np.float64) * math.exp(_SIGMA_S**2)
            shape = n_old * (w.mean() ** 2 / max(w.var(), 1e-300))
            hit = n_old > 0
            gam = np.zeros(p.rows)
            gam[hit] = rng.gamma(shape[hit]) / shape[hit]
            vb += n_old * w.mean() * gam
            # m keeps a trace of the latest old touch (β1^64 ≈ 1e-3: tiny, but not zero).
            first = 1 - rng.random(p.rows) ** (1 / np.maximum(n_old, 1))  # min of n uniforms
            last = k + np.floor(first * (big_t - k))
            mb += hit * (1 - b1) * b1**last
            mc += hit * (1 - b1) ** 2 * b1 ** (2 * last)
        n_cap = (1 + b2) / (1 - b2)
        jit = 1.0 / np.sqrt(1.0 + np.minimum(touch.sum(axis=1) + n_old, n_cap))
        return mb, mc, vb, jit, count_scale

    def _init_chunk(self, p: _Param, ci: int, r0: int, r1: int) -> None:
        rng = self._rng(p.tid, 4, 0, ci)
        w = p.w[r0:r1]
        if p.role == "norm":
            w[...] = _draw(rng, "gauss", w.shape)
            w *= _F32(0.1)
            np.exp(w, out=w)
            w *= _F32(p.w_mu)
        else:
            w[...] = _draw(rng, "weight", w.shape)
            w *= (_F32(p.w_mu) * p.w_row[r0:r1])[:, None]
            w *= p.w_col
        self._warm_chunk(p, r0, r1, rng)

    def _warm_chunk(self, p: _Param, r0: int, r1: int, rng: np.random.Generator) -> None:
        """Warm Adam state (module doc). ``v`` and m's noise omit the persistent mean's share
        of E[g²] (P² has mean 0.15² against 1.25 for the noise)."""
        m, v = p.m[r0:r1], p.v[r0:r1]
        if self.config.warm_steps == 0:
            m.fill(0)
            v.fill(0)
            return
        mb, mc, vb, jit, cscale = (a[r0:r1] for a in p.warm)
        var = 1 + _ALPHA_T**2  # E[g²] / (s ρ γ)²
        rs = p.g_scale * p.row[r0:r1].astype(np.float64) * np.sqrt(cscale)  # s ρ per row
        # m = s ρ γ · (mb · P + √(mc · var) · z), row and column factors folded in
        np.matmul((p.u0[r0:r1] * (mb * rs)[:, None]).astype(_F32), (p.v0 * p.col[:, None]).T, out=m)
        noise = _draw(rng, "gauss", m.shape)
        noise *= (np.sqrt(mc * var) * rs).astype(_F32)[:, None]
        noise *= p.col
        m += noise
        # v = (s ρ γ)² · vb · var · (jit · z² + 1 - jit): a chi-square-like jitter of mean 1
        v[...] = _draw(rng, "gauss_sq", v.shape)
        rv = vb * var * rs**2
        v *= (jit * rv).astype(_F32)[:, None]
        v += ((1 - jit) * rv).astype(_F32)[:, None]
        v *= np.square(p.col)

    # -- gradients and the update ---------------------------------------------------------------

    def _step_context(self, t: int, params: list[_Param]) -> dict:
        ctx: dict = {}
        for p in params:
            rng = self._rng(p.tid, 5, t)
            s = p.g_scale * math.exp(_SIGMA_S * rng.standard_normal() - _SIGMA_S**2 / 2)
            vt = rng.standard_normal((p.cols, _RANK_T), dtype=_F32)
            ctx[p.name] = (s, vt)
            if p.sparse and "counts" not in ctx:
                ctx["counts"] = self._rng(0, 6, t).poisson(self._lam)
        return ctx

    def _grad_chunk(self, p: _Param, t: int, ci: int, r0: int, r1: int, ctx: dict) -> np.ndarray:
        rng = self._rng(p.tid, 7, t, ci)
        s, vt = ctx[p.name]
        if not p.sparse:
            return _synth_rows(p, rng, slice(r0, r1), r1 - r0, s, vt, None)
        counts = ctx["counts"][r0:r1]
        rows = np.flatnonzero(counts)
        g = np.zeros((r1 - r0, p.cols), _F32)
        if rows.size:
            g[rows] = _synth_rows(
                p, rng, rows + r0, rows.size, s, vt, np.sqrt(counts[rows]).astype(_F32)
            )
        return g


def _synth_rows(
    p: _Param,
    rng: np.random.Generator,
    rows: slice | np.ndarray,
    n: int,
    s: float,
    vt: np.ndarray,
    row_mul: np.ndarray | None,
) -> np.ndarray:
    g = _draw(rng, "grad", (n, p.cols))
    ut = rng.standard_normal((n, _RANK_T), dtype=_F32)
    ut *= _F32(_ALPHA_T / math.sqrt(_RANK_T))
    a = np.concatenate([p.u0[rows], ut], axis=1)
    b = np.concatenate([p.v0, vt], axis=1)
    g += a @ b.T
    rs = p.row[rows] * _F32(s)
    if row_mul is not None:
        rs *= row_mul
    g *= rs[:, None]
    g *= p.col
    return g


def _adamw(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, scal: tuple) -> None:
    """torch single-tensor AdamW on one chunk, in place (``g`` is clobbered)."""
    decay, one_b1, b2, one_b2, bc2_sqrt, eps, neg_step = scal
    w *= decay
    tmp = np.subtract(g, m)
    tmp *= one_b1
    m += tmp  # exp_avg.lerp_(grad, 1 - beta1)
    v *= b2
    np.multiply(g, one_b2, out=tmp)
    tmp *= g
    v += tmp  # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
    np.sqrt(v, out=g)
    g /= bc2_sqrt
    g += eps  # denom
    np.multiply(m, neg_step, out=tmp)
    tmp /= g
    w += tmp  # param.addcdiv_(exp_avg, denom, -step_size)


def simulate(
    config: SimConfig, steps: int, *, copy: bool = False
) -> Iterator[dict[str, np.ndarray]]:
    """Yield the masters after each of ``steps`` AdamW steps (views unless ``copy``)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0 (got {steps!r})")
    sim = AdamSim(config)
    for _ in range(steps):
        sim.step()
        masters = sim.masters()
        yield {k: a.copy() for k, a in masters.items()} if copy else masters
