"""The served formats' tests' independent references: torch casts, ml_dtypes and float64
arithmetic written apart from rollpatch.formats, sample tensors with edge values, and
:func:`check` (a format's words and scales equal the reference's, bit for bit).

Importing it skips the importing module when torch is missing (the references need it).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from rollpatch.formats import FORMAT_NAMES
from rollpatch.view import View

torch = pytest.importorskip("torch")

W = "layers.0.mlp.up_proj.weight"
EPS = 2.0**-23
QUANTISED = [n for n in FORMAT_NAMES if n not in ("bf16", "fp16")]
GROUP = {"nvfp4": 16, "mxfp4": 32, "int4-g128": 128}
EDGES = np.array(
    [
        0.0,
        -0.0,
        1e-45,
        -1e-45,
        1.1754944e-38,
        -5e-39,
        1e-30,
        -1e-20,
        3.0e38,
        -3.3e38,
        3.4e38,
        448.0,
        -57344.0,
        0.25,
        0.75,
        -2.5,
        5.0,
        1e-3,
        65504.0,
        7.0,
    ],
    dtype=np.float32,
)
VECTOR_TORCH = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def words(t) -> np.ndarray:
    return t.data.reshape(t.shape)


def digests(out: dict) -> dict:
    return {k: t.digest() for k, t in out.items()}


def scale_keys(name: str) -> tuple[str, ...]:
    return {"fp8-e4m3-block128": ("_scale_inv",), "nvfp4": ("_scale", "_global_scale")}.get(
        name, ("_scale",)
    )


def sample(seed: int, shape: tuple[int, int], exp: int = -2, edges: float = 0.0) -> np.ndarray:
    """Gaussian master scaled by 10**exp with a fraction ``edges`` of edge values."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 10.0**exp).astype(np.float32)
    mask = rng.random(shape) < edges
    w[mask] = rng.choice(EDGES, size=int(mask.sum()))
    return w


# ---------------------------------------------------------------- independent references


def t_src(w: np.ndarray, mode: str):
    """|source| a scale is computed from: the master, or its BF16 rounding (saturated)."""
    t = torch.from_numpy(w)
    if mode != "fp32":
        top = torch.finfo(torch.bfloat16).max
        t = t.to(torch.bfloat16).float().clamp(-top, top)
    return t.abs()


def t_block_amax(a, br: int | None, bc: int | None):
    """Block maxima by zero-padding and reshaping; None = one block over the dimension."""
    n, k = a.shape
    nr, nc = (1 if br is None else -(-n // br)), (1 if bc is None else -(-k // bc))
    br, bc = br or max(n, 1), bc or max(k, 1)
    p = torch.zeros((nr * br, nc * bc))
    p[:n, :k] = a
    return p.reshape(nr, br, nc, bc).amax(dim=(1, 3))


def pack(codes: np.ndarray) -> np.ndarray:
    return (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)


def fp4_codes(y):
    """E2M1 RNE by thresholds (compressed-tensors' cast_to_fp4), sign from the sign bit."""
    a, mag = y.abs(), torch.zeros_like(y, dtype=torch.uint8)
    for code, (lo, incl) in enumerate(
        [(0.25, 0), (0.75, 1), (1.25, 0), (1.75, 1), (2.5, 0), (3.5, 1), (5.0, 0)], start=1
    ):
        mag[(a >= lo) if incl else (a > lo)] = code
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def reference(name: str, w: np.ndarray, mode: str, given: dict | None = None) -> dict:
    """Expected served arrays by name suffix; ``given`` pins scale words (frozen scales)."""
    n, k = w.shape
    wt, src, given = torch.from_numpy(w), t_src(w, mode), given or {}
    if name.startswith("fp8"):
        top, dt = (
            (57344.0, torch.float8_e5m2) if name == "fp8-e5m2" else (448.0, torch.float8_e4m3fn)
        )
        br, bc = {"fp8-e4m3-channel": (1, None), "fp8-e4m3-block128": (128, 128)}.get(
            name, (None, None)
        )
        scale = torch.clamp(t_block_amax(src, br, bc) / top, min=EPS)
        key = scale_keys(name)[0]
        if key in given:
            scale = torch.from_numpy(given[key].view(np.float32).reshape(scale.shape))
        full = scale.repeat_interleave(br or max(n, 1), 0).repeat_interleave(bc or max(k, 1), 1)
        q = (wt / full[:n, :k]).clamp(-top, top).to(dt).view(torch.uint8)
        return {"": q.numpy(), key: scale.numpy()}
    if name == "nvfp4":  # compressed-tensors' float32 recipe, step by step
        g = torch.tensor(2688.0) / (src.max() if src.numel() else torch.tensor(0.0))
        g = g if torch.isfinite(g) else torch.tensor(1.0)
        if "_global_scale" in given:
            g = torch.tensor(given["_global_scale"].view(np.float32)[0])
        s = (g * (t_block_amax(src, 1, 16) / 6.0)).clamp(max=448.0).to(torch.float8_e4m3fn)
        s = torch.where(s.float() == 0, torch.tensor(0.125).to(torch.float8_e4m3fn), s)
        if "_scale" in given:
            s = torch.from_numpy(given["_scale"]).view(torch.float8_e4m3fn)
        y = (wt.reshape(n, k // 16, 16) / (s.float() / g).unsqueeze(-1)).clamp(-6, 6)
        return {
            "_packed": pack(fp4_codes(y.reshape(n, k)).numpy()),
            "_scale": s.view(torch.uint8).numpy(),
            "_global_scale": np.array([g.item()], np.float32),
        }
    if name == "mxfp4":  # OCP MX in float64 + ml_dtypes' E2M1 cast
        amax = t_block_amax(src, 1, 32).numpy().astype(np.float64)
        e = np.array(
            [-127 if a == 0 else max(-127, math.floor(math.log2(a)) - 2) for a in amax.reshape(-1)],
            dtype=np.int64,
        ).reshape(n, k // 32)
        if "_scale" in given:
            e = given["_scale"].astype(np.int64) - 127
        y = w.astype(np.float64).reshape(n, k // 32, 32) / np.exp2(e)[..., None]
        codes = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
        return {"_packed": pack(codes.reshape(n, k)), "_scale": (e + 127).astype(np.uint8)}
    s = (t_block_amax(src, 1, 128) / 7.0).clamp(EPS, 65504.0).to(torch.float16)
    if "_scale" in given:
        s = torch.from_numpy(given["_scale"]).view(torch.float16)
    q = torch.round(wt / s.float().repeat_interleave(128, 1)).clamp(-8, 7).to(torch.int8)
    return {
        "_packed": pack(q.numpy().view(np.uint8)),
        "_scale": s.view(torch.int16).numpy().view(np.uint16),
    }


def check(name: str, w: np.ndarray, mode: str, out: dict, given: dict | None = None) -> None:
    for key, expected in reference(name, w, mode, given).items():
        got = out[W + key].data.view(np.uint8)
        np.testing.assert_array_equal(
            got,
            np.ascontiguousarray(expected).reshape(-1).view(np.uint8),
            err_msg=f"{name} {W + key}",
        )


def frozen_words(view: View, name: str) -> dict:
    return {key: words(view[W + key]) for key in scale_keys(name)}


def decode(out: dict, name: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(element values, per-element divisor) of a quantised tensor, decoded with ml_dtypes."""
    n, k = shape
    if name.startswith("fp8"):
        dt = ml_dtypes.float8_e5m2 if name == "fp8-e5m2" else ml_dtypes.float8_e4m3fn
        q = words(out[W]).view(dt).astype(np.float32)
        div = np.atleast_2d(out[W + scale_keys(name)[0]].to_array())
    else:
        packed = words(out[W + "_packed"])
        codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(n, k)
        sc = words(out[W + "_scale"])
        if name == "int4-g128":
            q = np.where(codes > 7, codes.astype(np.float32) - 16, codes).astype(np.float32)
            div = sc.view(np.float16).astype(np.float32)
        else:
            q = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
            div = (
                sc.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                / out[W + "_global_scale"].to_array()[0]
                if name == "nvfp4"
                else sc.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
            )
    rows, cols = (
        (128, 128)
        if name == "fp8-e4m3-block128"
        else (-(-n // div.shape[0]), -(-k // div.shape[1]))
    )
    return q, np.repeat(np.repeat(div, rows, 0), cols, 1)[:n, :k]
