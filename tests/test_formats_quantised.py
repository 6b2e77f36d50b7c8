"""Quantised served formats (FP8 with scales, NVFP4, MXFP4, INT4): bit-exact against the
independent references of tests/formatfix.py on Gaussian and edge values, rounding
boundaries, determinism, non-finite input, zero and empty tensors, nibble order, error
bounds, and the scale modes (frozen scales, BF16 vs FP32 scales).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpatch.errors import ConfigError, FormatError
from rollpatch.formats import FORMAT_NAMES, QuantPolicy, cast_view, get_format
from rollpatch.formats import blocks as blocks_mod
from rollpatch.formats import floats as floats_mod
from rollpatch.formats.floats import f32_to_bf16_bits
from rollpatch.formats.minifloat import E4M3, E5M2
from tests.formatfix import (
    GROUP,
    QUANTISED,
    W,
    check,
    decode,
    digests,
    frozen_words,
    sample,
    scale_keys,
    words,
)

# ---------------------------------------------------------------- quantised formats


@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("mode", ["bf16", "fp32"])
def test_gaussian_matches_reference(name, mode):
    w = sample(7, (130, 300 if name == "fp8-e4m3-block128" else 256))
    check(name, w, mode, get_format(name).cast_tensor(W, w, scales=mode))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(QUANTISED),
    mode=st.sampled_from(["bf16", "fp32"]),
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([0, 1, 3, 17, 129, 200]),
    kmul=st.integers(0, 4),
    kodd=st.integers(0, 140),
    exp=st.integers(-44, 37),
    edges=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
)
def test_edge_values_match_reference(name, mode, seed, n, kmul, kodd, exp, edges):
    w = sample(seed, (n, kmul * GROUP[name] if name in GROUP else kodd), exp, edges)
    check(name, w, mode, get_format(name).cast_tensor(W, w, scales=mode))


MIDPOINTS = {
    "fp8-e4m3": (E4M3.values[1:0x7F].astype(np.float64) + E4M3.values[:0x7E]) / 2,
    "fp8-e5m2": (E5M2.values[1:0x7C].astype(np.float64) + E5M2.values[:0x7B]) / 2,
    "nvfp4": np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]),
    "int4-g128": np.arange(-8, 7) + 0.5,
}


@pytest.mark.parametrize("name", QUANTISED)
def test_rounding_boundaries_match_reference(name):
    """Values at and one ulp around every rounding midpoint, under pinned (frozen) scales."""
    rng = np.random.default_rng(9)
    shape = (64, 256)
    spread = 10.0 ** rng.uniform(-4, 0, size=(64, 16)).repeat(16, axis=1)
    first = cast_view({W: (sample(8, shape) * spread).astype(np.float32)}, name, scales="fp32")
    mids = MIDPOINTS.get(name, MIDPOINTS["nvfp4" if name == "mxfp4" else "fp8-e4m3"])
    t = rng.choice(mids, size=shape) * (
        1.0 if name == "int4-g128" else rng.choice([-1.0, 1.0], size=shape)
    )
    w = (t * decode(first, name, shape)[1]).astype(np.float32)
    nudge = rng.integers(-1, 2, size=shape)
    w = np.where(nudge == 0, w, np.nextafter(w, np.where(nudge > 0, np.inf, -np.inf)))
    w = w.astype(np.float32)
    later = cast_view({W: w}, name, scales="frozen", previous=first)
    check(name, w, "fp32", later, given=frozen_words(first, name))


@pytest.mark.parametrize("name", ["nvfp4", "int4-g128", "fp8-e4m3-block128"])
def test_scale_rounding_boundaries_match_reference(name):
    """Block maxima chosen so the computed scale lands on (and one ulp around) a midpoint."""
    rng = np.random.default_rng(10)
    group = GROUP.get(name, 128)
    w = sample(13, (48, 256), -3)
    if name == "nvfp4":
        target = rng.choice(MIDPOINTS["fp8-e4m3"][8:80], (48, 16)) * 6.0 / (2688.0 / 1000.0)
    elif name == "int4-g128":
        f16 = np.arange(0x0400, 0x5000, 7, dtype=np.uint16).view(np.float16).astype(np.float64)
        target = rng.choice((f16[1:] + f16[:-1]) / 2, size=(48, 2)) * 7.0
    else:
        target = rng.choice(np.linspace(0.01, 5.0, 997), size=(48, 2)) * 448.0
    target = np.nextafter(
        target.astype(np.float32), np.where(rng.random(target.shape) < 0.5, np.inf, -np.inf)
    )
    cols = np.arange(target.shape[1]) * group + 5
    w[:, cols] = np.where(w[:, cols] > 0, 1, -1) * target.astype(np.float32)
    if name == "nvfp4":
        w[0, 0] = 1000.0
    check(name, w, "fp32", get_format(name).cast_tensor(W, w, scales="fp32"))


def test_chunking_does_not_change_bits(monkeypatch):
    w = sample(3, (300, 256), edges=0.02)
    before = {n: digests(get_format(n).cast_tensor(W, w)) for n in FORMAT_NAMES}
    monkeypatch.setattr(floats_mod, "CHUNK", 1000)
    monkeypatch.setattr(blocks_mod, "CHUNK", 1000)
    for n in FORMAT_NAMES:
        assert digests(get_format(n).cast_tensor(W, w)) == before[n], n


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_deterministic_and_master_dtype_independent(name):
    fmt = get_format(name)
    b = sample(11, (8, 256)).astype(ml_dtypes.bfloat16)
    runs = [digests(fmt.cast_tensor(W, m)) for m in (b, b.astype(np.float32), b.astype(">f4"))]
    assert runs[0] == runs[1] == runs[2]
    h = sample(12, (8, 256)).astype(np.float16)
    assert digests(fmt.cast_tensor(W, h)) == digests(fmt.cast_tensor(W, h.astype(np.float32)))


@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected_when_quantised(name, bad):
    w = sample(1, (4, 256))
    w[2, 37] = bad
    with pytest.raises(FormatError, match="up_proj"):
        get_format(name).cast_tensor(W, w)
    kept = get_format(name).cast_tensor(W, w, policy=QuantPolicy(exclude=("*up_proj*",)))[W]
    assert kept.dtype == "BF16"
    assert words(kept)[2, 37] == f32_to_bf16_bits(np.array([bad], np.float32))[0]


@pytest.mark.parametrize("name", QUANTISED)
def test_all_zero_and_empty_tensors_get_safe_scales(name):
    for shape in [(4, 256), (0, 256), (3, 0)]:
        out = get_format(name).cast_tensor(W, np.zeros(shape, np.float32))
        check(name, np.zeros(shape, np.float32), "bf16", out)
        if shape[0] and shape[1]:
            q, div = decode(out, name, shape)
            assert (q == 0).all() and np.isfinite(div).all() and (div > 0).all()


def test_nibble_order_and_layout():
    w = np.zeros((1, 128), np.float32)
    w[0, :4] = [6.0, -0.5, 1.0, 0.0]
    w[0, 127] = -3.0
    nv = get_format("nvfp4").cast_tensor(W, w, scales="fp32")
    assert list(words(nv[W + "_packed"])[0, :2]) == [0x97, 0x02]
    mx = get_format("mxfp4").cast_tensor(W, w, scales="fp32")
    assert list(words(mx[W + "_scale"])[0]) == [127, 0, 0, 126]  # floor(log2 amax) - 2; 0 → 0
    assert list(words(mx[W + "_packed"])[0, [0, 63]]) == [0x97, 0xF0]
    i4 = get_format("int4-g128").cast_tensor(W, w, scales="fp32")
    s = float(words(i4[W + "_scale"]).view(np.float16)[0, 0])
    assert s == np.float16(6.0 / 7.0)
    assert words(i4[W + "_packed"])[0, 0] == ((round(-0.5 / s) & 0xF) << 4) | 7


@pytest.mark.parametrize("name", QUANTISED)
def test_dequantisation_error_bounds(name):
    w = sample(5, (64, 512))
    q, div = decode(get_format(name).cast_tensor(W, w), name, w.shape)
    rel = {"fp8-e5m2": 2.0**-3, "int4-g128": 0.0}.get(name, 2.0**-4)
    half_step = {"fp8-e4m3": 2.0**-10, "fp8-e5m2": 2.0**-17, "int4-g128": 0.5}.get(
        name, 2.0**-10 if name.startswith("fp8") else 0.25
    )
    if name in ("nvfp4", "mxfp4"):
        rel = 0.25
    bound = np.maximum(rel * np.abs(w), half_step * div) * (1 + 1e-6)
    assert (np.abs(q * div - w) <= bound).all()


# ---------------------------------------------------------------- scale modes


@pytest.mark.parametrize("name", QUANTISED)
def test_frozen_scales_are_reused_and_saturate(name):
    w = sample(21, (130, 256))
    first = cast_view({W: w}, name)
    w2 = w * np.float32(3.0)
    later = cast_view({W: w2, "new.weight": w2}, name, scales="frozen", previous=first)
    for key, old in frozen_words(first, name).items():
        np.testing.assert_array_equal(words(later[W + key]), old)
    fresh = cast_view({"new.weight": w2}, name)  # missing from previous: computed (bf16)
    assert all(later[k].digest() == t.digest() for k, t in fresh.items())
    check(name, w2, "bf16", later, given=frozen_words(first, name))
    if name.startswith("fp8"):
        assert (words(later[W]) & 0x7F).max() == (0x7B if name == "fp8-e5m2" else 0x7E)


def test_frozen_mismatches_are_errors():
    w = sample(2, (8, 256))
    prev = cast_view({W: w}, "fp8-e4m3-channel")
    with pytest.raises(FormatError, match="layout"):
        cast_view({W: w[:4]}, "fp8-e4m3-channel", scales="frozen", previous=prev)
    with pytest.raises(ConfigError, match="same format"):
        cast_view({W: w}, "fp8-e4m3", scales="frozen", previous=prev)
    prev[W + "_scale"].data[:] = 0
    with pytest.raises(FormatError, match="zero"):
        cast_view({W: w}, "fp8-e4m3-channel", scales="frozen", previous=prev)
    assert (
        cast_view({W: w}, "fp8-e4m3-channel", previous=prev).metadata["rollpatch.scales"] == "bf16"
    )  # previous is only read when frozen
    prev = cast_view({W: w}, "nvfp4")
    prev[W + "_scale"].data[3] = 0x7F
    with pytest.raises(FormatError, match="non-finite"):
        cast_view({W: w}, "nvfp4", scales="frozen", previous=prev)


@pytest.mark.parametrize("name", ["fp8-e4m3-channel", "fp8-e4m3-block128", "int4-g128"])
def test_bf16_scales_barely_move_fp32_scales_churn(name):
    w = sample(4, (256, 1024))
    step = np.random.default_rng(4).choice([-1e-5, 1e-5], size=w.shape).astype(np.float32)
    changed = {}
    for mode in ("bf16", "fp32"):
        a, b = (get_format(name).cast_tensor(W, m, scales=mode) for m in (w, w + step))
        changed[mode] = np.mean([np.mean(a[W + k].data != b[W + k].data) for k in scale_keys(name)])
    assert changed["bf16"] < 0.1 and changed["fp32"] > 0.5, changed
