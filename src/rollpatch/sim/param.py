"""One simulated tensor (:class:`_Param`), its per-element draws and its synthetic gradient.

All per-element randomness goes through 65,536-entry quantile tables indexed by uniform 16-bit
integers (the package docstring says why); the gradient of a block of rows is
``s · ρ · γ · (ε + P + L_t)``.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from functools import cache

import numpy as np

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
    "router": 0.02,
}


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
    if name.endswith(".mlp.gate.weight"):
        return "router"
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
        #: index of the routed expert this tensor belongs to (-1: not an expert)
        self.expert = int(name.split(".")[5]) if ".mlp.experts." in name else -1
        self.w_mu = 1.0  # weight scale σ (norms: mean μ)
        self.w_row = self.w_col = self.row  # weight row/column scales (init only)
        self.warm: tuple[np.ndarray, ...] = ()  # per-row warm-state coefficients


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
