"""The AdamW simulator: determinism, layout, torch parity, and the realism the bench relies on."""

from __future__ import annotations

import itertools
import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from rollpatch.sim import AdamSim, SimConfig, llama_dims, simulate

SMALL_PARAMS = 2_000_000


def small(**kw: Any) -> SimConfig:
    """A ~2M-parameter model with a 1000-token vocabulary: fast, still every tensor kind."""
    return SimConfig(n_params=SMALL_PARAMS, vocab=1000, batch_tokens=4096, **kw)


def _bf16_words(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).view(np.uint16)


@pytest.mark.parametrize(
    "field,value",
    [
        ("n_params", 10),
        ("seed", -1),
        ("lr", 0.0),
        ("lr", 2.0),
        ("betas", (0.9,)),
        ("betas", (0.9, 1.0)),
        ("eps", 0.0),
        ("weight_decay", -0.1),
        ("warm_steps", -1),
        ("vocab", 3),
        ("batch_tokens", 0),
        ("zipf_exponent", 0.0),
        ("threads", 0),
    ],
)
def test_config_rejects_bad_fields_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SimConfig(**{field: value})  # type: ignore[arg-type]


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = SimConfig()
    with pytest.raises(AttributeError):
        cfg.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        SimConfig(1_000_000)  # type: ignore[call-arg]


@pytest.mark.parametrize("n", [20_000_000, 100_000_000, 1_000_000_000, 7_000_000_000])
def test_layout_size_near_target(n: int) -> None:
    dims = llama_dims(n)
    assert abs(dims.n_params / n - 1) < 0.05
    assert dims.heads % dims.kv_heads == 0
    assert dims.hidden == dims.heads * dims.head_dim


def test_layout_names_and_shapes() -> None:
    sim = AdamSim(small())
    lay = sim.layout()
    d, v = sim.dims.hidden, sim.dims.vocab
    assert v == 1000
    assert lay["model.embed_tokens.weight"] == (v, d)
    assert lay["lm_head.weight"] == (v, d)
    assert lay["model.norm.weight"] == (d,)
    for i in range(sim.dims.layers):
        pre = f"model.layers.{i}."
        assert lay[pre + "mlp.down_proj.weight"] == (d, sim.dims.intermediate)
        assert lay[pre + "self_attn.k_proj.weight"] == (sim.dims.kv_heads * sim.dims.head_dim, d)
        assert lay[pre + "input_layernorm.weight"] == (d,)
    assert sum(math.prod(s) for s in lay.values()) == sim.n_params
    assert abs(sim.n_params / SMALL_PARAMS - 1) < 0.05
    masters = sim.masters()
    assert list(masters) == list(lay)
    assert all(masters[k].shape == lay[k] and masters[k].dtype == np.float32 for k in lay)


def test_deterministic_bitwise_and_independent_of_threads() -> None:
    runs = []
    for threads in (1, 2, 1):
        sim = AdamSim(small(seed=7, threads=threads))
        sim.step()
        sim.step()
        runs.append({k: a.copy() for k, a in sim.masters().items()})
    for other in runs[1:]:
        for k in runs[0]:
            assert runs[0][k].tobytes() == other[k].tobytes(), k
    other_seed = AdamSim(small(seed=8)).masters()
    assert not np.array_equal(other_seed["lm_head.weight"], runs[0]["lm_head.weight"])


def test_gradient_is_what_step_uses() -> None:
    a = AdamSim(small())
    b = AdamSim(small())
    a.step()
    b.step(grads={k: b.gradient(k, 1) for k in b.layout()})
    assert a.step_count == b.step_count == 1
    for k, w in a.masters().items():
        assert w.tobytes() == b.masters()[k].tobytes(), k


def test_embedding_gradient_rows_are_sparse_and_zipfian() -> None:
    sim = AdamSim(small())
    g = sim.gradient("model.embed_tokens.weight", 1)
    touched = np.any(g != 0, axis=1)
    assert 0.05 < touched.mean() < 0.95
    # BPE-like: low token ids are frequent, so they are touched more often.
    assert touched[:100].mean() > touched[-300:].mean()
    assert np.all(sim.gradient("lm_head.weight", 1) != 0)


def test_step_rejects_bad_grads() -> None:
    sim = AdamSim(small())
    with pytest.raises(ValueError, match="unknown"):
        sim.step(grads={"nope": np.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        sim.step(grads={"model.norm.weight": np.zeros(3)})
    assert sim.step_count == 0


@pytest.mark.parametrize("warm_steps", [0, 1000])
def test_adamw_matches_torch(warm_steps: int) -> None:
    torch = pytest.importorskip("torch")
    cfg = small(lr=1e-3, weight_decay=0.1, warm_steps=warm_steps)
    sim = AdamSim(cfg)
    name = "model.layers.1.self_attn.q_proj.weight"
    w0 = sim.masters()[name].copy()
    m0, v0 = (a.copy() for a in sim.adam_state(name))
    param = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.AdamW(
        [param], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if warm_steps:
        opt.state[param] = {
            "step": torch.tensor(float(warm_steps)),
            "exp_avg": torch.from_numpy(m0.copy()),
            "exp_avg_sq": torch.from_numpy(v0.copy()),
        }
    rng = np.random.default_rng(1)
    for _ in range(3):
        g = (rng.standard_normal(w0.shape) * 1e-4).astype(np.float32)
        sim.step(grads={name: g})
        param.grad = torch.from_numpy(g.copy())
        opt.step()
    m, v = sim.adam_state(name)
    st = opt.state[param]
    # torch fuses lerp (and on some builds addcmul) with an FMA, numpy cannot: the moments
    # agree to float32 rounding (m cancels near zero, hence the absolute floor) and the
    # weights to a ten-thousandth of one update.
    for ours, theirs in ((m, st["exp_avg"].numpy()), (v, st["exp_avg_sq"].numpy())):
        np.testing.assert_allclose(
            ours, theirs, rtol=4e-7, atol=4e-7 * float(np.sqrt(np.mean(theirs**2)))
        )
    np.testing.assert_allclose(
        sim.masters()[name], param.detach().numpy(), rtol=0, atol=1e-4 * cfg.lr
    )
    assert np.mean(sim.masters()[name] == param.detach().numpy()) > 0.8
    assert float(st["step"]) == warm_steps + 3
    assert not np.array_equal(sim.masters()[name], w0)


def _adam_u(m: np.ndarray, v: np.ndarray, t: int, cfg: SimConfig) -> np.ndarray:
    b1, b2 = cfg.betas
    return (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + cfg.eps)


def _warm_vs_real(cfg: SimConfig, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """|update|/lr from the analytic warm state, and from a real EMA over as many steps."""
    sim = AdamSim(cfg)
    b1, b2 = cfg.betas
    warm, real = [], []
    for name in names:
        m = np.zeros(sim.layout()[name], np.float32)
        v = np.zeros_like(m)
        for t in range(1, cfg.warm_steps + 1):
            g = sim.gradient(name, 10_000 + t)
            m += (1 - b1) * (g - m)
            v = b2 * v + (1 - b2) * g * g
        real.append(np.abs(_adam_u(m, v, cfg.warm_steps, cfg)).ravel())
        warm.append(np.abs(_adam_u(*sim.adam_state(name), cfg.warm_steps, cfg)).ravel())
    return np.concatenate(warm), np.concatenate(real)


def test_warm_state_matches_a_real_warmup_dense() -> None:
    """The analytic warm start has the |update| law of a real EMA run of the same length.

    Pooled over tensors: each tensor's gradient scale jitters step to step, so one tensor's
    |update| law at one step moves by ~10% in both the real run and the warm state.
    """
    names = [
        f"model.layers.{i}.{t}"
        for i in (0, 1)
        for t in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    ]
    warm, real = _warm_vs_real(small(warm_steps=1000), names)
    qs = [0.25, 0.5, 0.9, 0.99]
    np.testing.assert_allclose(np.quantile(warm, qs), np.quantile(real, qs), rtol=0.1)
    assert 0.15 < np.sqrt(np.mean(warm**2)) < 0.4


def test_warm_state_matches_a_real_warmup_embedding() -> None:
    """Same for the sparsely touched embedding rows (rare tokens: no state, or a big one)."""
    pairs = [
        _warm_vs_real(small(warm_steps=1000, seed=s), ["model.embed_tokens.weight"])
        for s in range(3)
    ]
    warm = np.concatenate([w for w, _ in pairs])
    real = np.concatenate([r for _, r in pairs])
    qs = [0.5, 0.9, 0.99]
    np.testing.assert_allclose(np.quantile(warm, qs), np.quantile(real, qs), rtol=0.15)
    assert abs(np.mean(warm == 0) - np.mean(real == 0)) < 0.02  # never-seen tokens


def _bf16_change(lr: float, steps: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(changed flags, |w| before) over all elements and ``steps`` steps of a 20M model."""
    sim = AdamSim(SimConfig(n_params=20_000_000, lr=lr))
    flags, mags = [], []
    for _ in range(steps):
        before = {k: (_bf16_words(a), np.abs(a)) for k, a in sim.masters().items()}
        sim.step()
        for k, a in sim.masters().items():
            flags.append((_bf16_words(a) != before[k][0]).ravel())
            mags.append(before[k][1].ravel())
    return np.concatenate(flags), np.concatenate(mags)


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_bf16_change_fraction_is_realistic(lr: float) -> None:
    changed, _ = _bf16_change(lr)
    frac = changed.mean()
    assert 5e-4 < frac < 0.08, frac  # PULSE: ~1% per step; slime: ~3%; Stitch: 0.25%


def test_bf16_change_grows_with_lr_and_shrinks_with_exponent() -> None:
    lo, _ = _bf16_change(1e-6, steps=1)
    changed, mag = _bf16_change(3e-6, steps=1)
    assert changed.mean() > 2 * lo.mean()
    exp = np.floor(np.log2(np.maximum(mag, 1e-30))).astype(int)
    probs = []
    for e in range(-12, -4):  # |w| from 2^-12 to 2^-4: the bulk of linear weights
        sel = exp == e
        assert sel.sum() > 10_000
        probs.append(changed[sel].mean())
    # Rounding gap doubles per exponent while |Δw| does not: change odds fall with |w|.
    assert all(a > b for a, b in itertools.pairwise(probs)), probs
    assert probs[0] > 8 * probs[-1]


def test_simulate_yields_views_or_copies() -> None:
    cfg = small()
    views = list(simulate(cfg, 2))
    assert len(views) == 2
    assert views[0]["lm_head.weight"] is not None
    copies = list(simulate(cfg, 2, copy=True))
    assert not np.array_equal(copies[0]["lm_head.weight"], copies[1]["lm_head.weight"])
    assert np.array_equal(copies[1]["lm_head.weight"], views[1]["lm_head.weight"])
    with pytest.raises(ValueError, match="steps"):
        list(simulate(cfg, -1))
