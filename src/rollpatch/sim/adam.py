"""The simulator: :class:`AdamSim` (model construction, warm Adam state, steps) and
:func:`simulate`; the arithmetic is torch's single-tensor AdamW in float32 (:func:`_adamw`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .config import SimConfig, llama_dims
from .moe import expert_shares, moe_dims
from .param import (
    _ALPHA_P,
    _ALPHA_T,
    _F32,
    _RANK_P,
    _RANK_T,
    _ROLE_SIGMA,
    _SIGMA_S,
    _WARM_WINDOW,
    _draw,
    _Param,
    _quantile_tables,
    _synth_rows,
)

__all__ = ["AdamSim", "simulate"]


class AdamSim:
    """Consecutive FP32 master versions of a Llama-like model under AdamW (see module doc).

    ``masters()`` returns views into the live state; ``step()`` advances it in place.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        moe = config.moe
        self.dims = (
            moe_dims(config.n_params, config.vocab, moe)
            if moe
            else llama_dims(config.n_params, config.vocab)
        )
        self.step_count = 0
        self._threads = config.threads or os.cpu_count() or 1
        self._params: dict[str, _Param] = {}
        for name, shape in self.dims.layout().items():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            self._params[name] = _Param(name, shape, layer)
        _quantile_tables()
        self._token_model()
        #: MoE layer → expected token-expert assignments per expert per step
        self._expert_lam = {
            i: expert_shares(moe, i, config.seed) * (config.batch_tokens * moe.top_k)
            for i in range(self.dims.layers)
            if moe and self.dims.is_moe(i)
        }
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

    def expert_load(self, layer: int) -> np.ndarray:
        """Expected token-expert assignments per step of each expert of an MoE ``layer``."""
        if layer not in self._expert_lam:
            raise ValueError(f"layer {layer!r} has no routed experts")
        return self._expert_lam[layer].copy()

    def expert_counts(self, layer: int, step: int) -> np.ndarray:
        """Tokens routed to each expert of an MoE ``layer`` at simulator step ``step`` (>= 1)."""
        if step < 1:
            raise ValueError(f"step must be >= 1 (got {step!r})")
        self.expert_load(layer)
        return self._counts(layer, step)

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
        erng = None
        if p.expert >= 0:  # one touch history for the expert's three tensors
            lam = float(self._expert_lam[p.layer][p.expert])
            erng = self._rng(_expert_id(p.layer, p.expert), 9)
            prob = np.full(p.rows, -math.expm1(-lam))
            touch = np.broadcast_to(erng.random(k) < prob[0], (p.rows, k))
            count_scale = np.full(p.rows, lam / max(prob[0], 1e-30))
        elif p.sparse:
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
        old_rng, old_rows = (erng, 1) if erng is not None else (rng, p.rows)
        n_old = (
            np.broadcast_to(old_rng.binomial(big_t - k, prob[:old_rows]), (p.rows,))
            if big_t > k
            else np.zeros(p.rows, np.int64)
        )
        if big_t > k:
            w = (1 - b2) * b2 ** np.arange(k, big_t, dtype=np.float64) * math.exp(_SIGMA_S**2)
            shape = n_old * (w.mean() ** 2 / max(w.var(), 1e-300))
            hit = n_old > 0
            gam = np.zeros(p.rows)
            if erng is not None:
                gam[hit] = erng.gamma(shape[0]) / shape[0] if hit[0] else 0.0
            else:
                gam[hit] = rng.gamma(shape[hit]) / shape[hit]
            vb += n_old * w.mean() * gam
            # m keeps a trace of the latest old touch (β1^64 ≈ 1e-3: tiny, but not zero).
            u = old_rng.random(old_rows)
            first = 1 - u ** (1 / np.maximum(n_old, 1))  # min of n uniforms
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
            if p.expert >= 0 and ("experts", p.layer) not in ctx:
                ctx["experts", p.layer] = self._counts(p.layer, t)
        return ctx

    def _counts(self, layer: int, t: int) -> np.ndarray:
        return self._rng(0, 8, t, layer).poisson(self._expert_lam[layer])

    def _grad_chunk(self, p: _Param, t: int, ci: int, r0: int, r1: int, ctx: dict) -> np.ndarray:
        rng = self._rng(p.tid, 7, t, ci)
        s, vt = ctx[p.name]
        if p.expert >= 0:
            count = int(ctx["experts", p.layer][p.expert])
            if count == 0:  # no token routed here this step: no gradient
                return np.zeros((r1 - r0, p.cols), _F32)
            mul = np.full(r1 - r0, math.sqrt(count), _F32)
            return _synth_rows(p, rng, slice(r0, r1), r1 - r0, s, vt, mul)
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


def _expert_id(layer: int, expert: int) -> int:
    return (1 << 31) | (layer << 16) | expert


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
