"""Served formats: BF16, FP16 and the small floats bit-exact against torch and ml_dtypes (any
bits, NaN rules, native masters); the policy, cast views and the registry.

The quantised formats: test_formats_quantised.py; the references: tests/formatfix.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpatch.errors import ConfigError, FormatError
from rollpatch.formats import FORMAT_NAMES, Format, QuantPolicy, cast_view, get_format
from rollpatch.formats.floats import f32_to_bf16_bits, f32_to_f16_bits
from rollpatch.formats.minifloat import E2M1, E4M3, E5M2, encode
from tests.formatfix import GROUP, VECTOR_TORCH, W, sample, torch, words

# ---------------------------------------------------------------- BF16 / FP16 / small floats


def torch_bits(x: np.ndarray, dtype) -> np.ndarray:
    return torch.from_numpy(x).to(dtype).view(torch.int16).numpy().view(np.uint16)


def test_bf16_fp16_match_torch_and_ml_dtypes_over_float32_bits():
    x = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ties = np.array(
        [
            0x3F808000,
            0x3F818000,
            0x3F80FFFF,
            0x00008000,
            0x00018000,
            0x7F7F8000,
            0x7F7FFFFF,
            0xFF7F8000,
            0x80000001,
            0x7F800000,
        ],
        np.uint32,
    ).view(np.float32)
    halves = np.array(
        [65519.0, 65520.0, 5.96e-8, 2.98e-8, 2.9802326e-08, 1e-8, 1e5, 6.1035156e-05, 6.103515e-05],
        dtype=np.float32,
    )
    x = np.concatenate([x, ties, halves, -halves])
    finite = x[~np.isnan(x)]
    np.testing.assert_array_equal(f32_to_bf16_bits(finite), torch_bits(finite, torch.bfloat16))
    np.testing.assert_array_equal(
        f32_to_bf16_bits(finite), finite.astype(ml_dtypes.bfloat16).view(np.uint16)
    )
    np.testing.assert_array_equal(f32_to_f16_bits(x), torch_bits(x, torch.float16))


def test_nan_rules():
    nans = np.array(
        [0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00000, 0x7FA00000, 0xFFBFFFFF],
        dtype=np.uint32,
    ).view(np.float32)
    ours = f32_to_bf16_bits(nans)
    assert (ours == 0xFFFF).all()
    if VECTOR_TORCH:
        np.testing.assert_array_equal(ours, torch_bits(nans, torch.bfloat16))
    assert np.isnan(ours.view(ml_dtypes.bfloat16).astype(np.float32)).all()
    np.testing.assert_array_equal(f32_to_f16_bits(nans), torch_bits(nans, torch.float16))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=0, max_size=64))
def test_bf16_fp16_formats_on_any_bits(bits):
    x = np.array(bits, dtype=np.uint32).view(np.float32).reshape(-1, 1)
    bf = get_format("bf16").cast_tensor(W, x)[W]
    f16 = get_format("fp16").cast_tensor(W, x)[W]
    assert bf.shape == f16.shape == x.shape and (bf.dtype, f16.dtype) == ("BF16", "F16")
    if VECTOR_TORCH:
        np.testing.assert_array_equal(words(bf), torch_bits(x, torch.bfloat16))
    np.testing.assert_array_equal(words(f16), torch_bits(x, torch.float16))


def test_native_masters_pass_through_bit_for_bit():
    raw = np.array([0x7FA1, 0xFFC1, 0x8000, 0x0001, 0x3F80, 0x7F80], dtype=np.uint16)
    bf = get_format("bf16").cast_tensor(W, raw.view(ml_dtypes.bfloat16).reshape(1, 2, 3))[W]
    assert bf.shape == (1, 2, 3) and (bf.data == raw).all()
    half = np.array([0x7C01, 0xFE05, 0x8000, 0x0001], dtype=np.uint16)
    assert (get_format("fp16").cast_tensor(W, half.view(np.float16))[W].data == half).all()
    via = get_format("fp16").cast_tensor(W, raw.view(ml_dtypes.bfloat16))[W]
    np.testing.assert_array_equal(
        via.data, torch_bits((raw.astype(np.uint32) << 16).view(np.float32), torch.float16)
    )
    scalar = get_format("fp8-e4m3").cast_tensor(W, np.array(1.5, np.float32))[W]
    assert scalar.shape == () and scalar.dtype == "BF16" and scalar.data[0] == 0x3FC0


@pytest.mark.parametrize("spec", [E4M3, E5M2, E2M1], ids=lambda s: s.name)
def test_minifloat_encode_matches_torch_and_ml_dtypes(spec):
    x = np.arange(0, 0x7F800000, 1237, dtype=np.uint32).view(np.float32)
    mids = np.unique(np.abs(spec.values[np.isfinite(spec.values)]))
    mids = ((mids[1:].astype(np.float64) + mids[:-1]) / 2).astype(np.float32)
    x = np.concatenate([x, mids, np.nextafter(mids, 0), np.nextafter(mids, 1)])
    x = np.concatenate([x, -x])
    x = x[np.abs(x) <= spec.max_value]
    ours = encode(spec, x)
    mld = {
        "e4m3": ml_dtypes.float8_e4m3fn,
        "e5m2": ml_dtypes.float8_e5m2,
        "e2m1": ml_dtypes.float4_e2m1fn,
    }[spec.name]
    np.testing.assert_array_equal(ours, x.astype(mld).view(np.uint8))
    tdt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(spec.name)
    if tdt is not None:
        np.testing.assert_array_equal(ours, torch.from_numpy(x).to(tdt).view(torch.uint8))
    np.testing.assert_array_equal(spec.values[ours], x.astype(mld).astype(np.float32))


# ---------------------------------------------------------------- policy, views, registry


def test_policy():
    p = QuantPolicy()
    assert p.quantise("model.layers.0.self_attn.q_proj.weight", (64, 64))
    for name, shape in [
        ("model.embed_tokens.weight", (64, 64)),
        ("lm_head.weight", (64, 64)),
        ("model.norm.weight", (64,)),
        ("encoder.LayerNorm.weight", (64, 64)),
        ("model.layers.0.q_proj.bias", (64, 64)),
        ("x.weight", (2, 4, 4)),
    ]:
        assert not p.quantise(name, shape), name
    p = QuantPolicy(include=("*.q_proj.weight", "lm_head.weight"), exclude=("layers.1.*",))
    assert p.quantise("layers.0.q_proj.weight", (64, 64)) and p.quantise("lm_head.weight", (2, 2))
    assert not p.quantise("layers.1.q_proj.weight", (64, 64))
    assert not p.quantise("layers.0.k_proj.weight", (64, 64))
    with pytest.raises(ConfigError, match="include"):
        QuantPolicy(include="*.weight")


EXPECTED = {  # name: served suffix → (dtype, kind, shape) for l.q.weight [64, 256]
    "bf16": {"": ("BF16", "bf16", (64, 256))},
    "fp16": {"": ("F16", "f16", (64, 256))},
    "fp8-e4m3": {"": ("F8_E4M3", "e4m3", (64, 256)), "_scale": ("F32", "f32", ())},
    "fp8-e4m3-channel": {"": ("F8_E4M3", "e4m3", (64, 256)), "_scale": ("F32", "f32", (64, 1))},
    "fp8-e4m3-block128": {"": ("F8_E4M3", "e4m3", (64, 256)), "_scale_inv": ("F32", "f32", (1, 2))},
    "fp8-e5m2": {"": ("F8_E5M2", "e5m2", (64, 256)), "_scale": ("F32", "f32", ())},
    "nvfp4": {
        "_packed": ("U8", "e2m1x2", (64, 128)),
        "_scale": ("F8_E4M3", "e4m3", (64, 16)),
        "_global_scale": ("F32", "f32", (1,)),
    },
    "mxfp4": {"_packed": ("U8", "e2m1x2", (64, 128)), "_scale": ("U8", "e8m0_u8", (64, 8))},
    "int4-g128": {"_packed": ("U8", "int4x2", (64, 128)), "_scale": ("F16", "f16", (64, 2))},
}


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_cast_view_names_shapes_kinds(name):
    masters = {
        "model.embed_tokens.weight": np.ones((64, 256), np.float32),
        "model.norm.weight": np.ones(256, np.float32),
        "l.q.bias": np.ones(64, np.float32),
        "l.q.weight": sample(1, (64, 256)),
        "l.odd.weight": sample(2, (64, 24)),
    }
    view = cast_view(masters, name)
    assert view.metadata == {"rollpatch.format": name, "rollpatch.scales": "bf16"}
    served = {"l.q.weight" + s: spec for s, spec in EXPECTED[name].items()}
    plain = ("F16", "f16") if name == "fp16" else ("BF16", "bf16")
    for m in ("model.embed_tokens.weight", "model.norm.weight", "l.q.bias"):
        served[m] = (*plain, masters[m].shape)
    if name in GROUP:  # K=24 cannot be grouped: stays BF16
        served["l.odd.weight"] = (*plain, (64, 24))
    else:  # fp8 scales per tensor / row / partial 128-block
        served["l.odd.weight"] = (*EXPECTED[name][""][:2], (64, 24))
        for suffix, (dtype, kind, shape) in EXPECTED[name].items():
            if suffix:
                served["l.odd.weight" + suffix] = (dtype, kind, shape[:1] and (shape[0], 1))
    assert set(view) == set(served)
    for key, spec in served.items():
        assert (view[key].dtype, view[key].kind.name, view[key].shape) == spec, key


def test_registry_and_errors():
    assert FORMAT_NAMES == (
        "bf16",
        "fp16",
        "fp8-e4m3",
        "fp8-e4m3-channel",
        "fp8-e4m3-block128",
        "fp8-e5m2",
        "nvfp4",
        "mxfp4",
        "int4-g128",
    )
    assert all(isinstance(get_format(n), Format) and get_format(n).name == n for n in FORMAT_NAMES)
    with pytest.raises(ConfigError, match="fp8-e4m3-block128"):
        get_format("fp8")
    with pytest.raises(ConfigError, match="scale mode"):
        cast_view({}, "bf16", scales="exact")
    with pytest.raises(FormatError, match="float64"):
        get_format("bf16").cast_tensor(W, np.zeros(3))
    with pytest.raises(FormatError, match="same served name"):
        cast_view(
            {"a.weight": np.ones((4, 4), np.float32), "a.weight_scale": np.ones(1, np.float32)},
            "fp8-e4m3",
        )
    fp8 = cast_view(
        {W: sample(1, (4, 16))},
        get_format("fp8-e4m3"),
        scales="fp32",
        policy=QuantPolicy(exclude=("*.up_proj.*",)),
    )
    assert list(fp8) == [W] and fp8[W].dtype == "BF16"
    assert fp8.metadata["rollpatch.scales"] == "fp32"
