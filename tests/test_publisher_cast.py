"""The publisher's torch BF16 cast (``publisher/cast.py``): one pass over the master, the NaN
check on the BF16 result. It must give formats' bits exactly (NaN → 0xFFFF, ±inf and
subnormals kept, ties to even) wherever the NaNs lie, and the host snapshot that uses it must
refuse what it refused before, with the same error."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rollpatch.errors import FormatError
from rollpatch.formats import cast_view
from rollpatch.formats.floats import BF16_NAN, f32_to_bf16_bits
from rollpatch.publisher import Publisher, PublisherConfig, snapshot
from rollpatch.publisher.cast import CAST_CHUNK, bf16_words, castable, host_words
from rollpatch.store import MemoryStore
from tests.pubfix import RUN, random_masters
from tests.test_publisher_device import SPECIAL

NANS = [0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF]


def _f32(bits: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def test_cast_equals_formats_on_every_special_and_random_bits() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            _f32(SPECIAL + NANS),
            rng.standard_normal(200_003).astype(np.float32) * 0.02,
            rng.integers(0, 2**32, 150_001, dtype=np.uint32).view(np.float32),  # NaNs too
        ]
    )
    got = host_words(x)
    assert got.dtype == np.uint16 and np.array_equal(got, f32_to_bf16_bits(x))
    assert not np.shares_memory(got, x)


@pytest.mark.parametrize(
    "where",
    [0, 5, CAST_CHUNK - 1, CAST_CHUNK, CAST_CHUNK + 17, 2 * CAST_CHUNK + 40],
    ids=lambda w: f"nan@{w}",
)
def test_a_lone_nan_anywhere_becomes_0xffff(where: int) -> None:
    """The check reads each chunk's result: a NaN in the first, a later, or the short last
    chunk, in a vector body or a scalar tail, is found and pinned, and nothing else moves."""
    rng = np.random.default_rng(where)
    x = rng.standard_normal(2 * CAST_CHUNK + 41).astype(np.float32)
    for bits in NANS:
        x[where] = _f32([bits])[0]
        got = host_words(x)
        assert got[where] == BF16_NAN
        assert np.array_equal(got, f32_to_bf16_bits(x))


def test_bf16_and_fp16_masters_and_infinities() -> None:
    """±inf stay ±inf (BF16 refuses nothing); finite values past the BF16 range round to
    ±inf; BF16 masters keep every bit; FP16 masters round once."""
    x = _f32([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000])
    assert host_words(x).tolist() == [0x7F80, 0xFF80, 0x7F80, 0xFF80, 0x3F80]
    words = np.array([0x7FC1, 0xFF81, 0x7F80, 0x8000, 0x0001], np.uint16)
    bf = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    assert np.array_equal(bf16_words(bf).numpy().view(np.uint16), words)
    h = np.array([np.nan, -np.inf, 65504.0, 6e-8, -0.0], np.float16)
    ref = cast_view({"h": h}, "bf16")["h"].data
    assert np.array_equal(bf16_words(torch.from_numpy(h)).numpy().view(np.uint16), ref)


def test_castable_leaves_odd_arrays_to_formats() -> None:
    x = np.ones((4, 6), np.float32)
    assert castable(x)
    ro = x.copy()
    ro.flags.writeable = False
    assert not castable(ro)  # torch reads numpy memory only through writable arrays
    assert not castable(x[:, ::2]) and not castable(x.astype(">f4"))
    assert not castable(np.ones(0, np.float32)) and not castable(x.astype(np.float16))
    with pytest.raises(TypeError):
        host_words(ro)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-e4m3", "nvfp4"])
def test_snapshot_with_torch_is_formats_cast(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host snapshot takes the torch cast for every tensor the format serves as BF16 (all
    of them under ``bf16``; norms and small tensors under quantised formats) and formats'
    cast for the rest: the same view as ``cast_view``, and as the numpy-only snapshot."""
    masters = random_masters(7, n=3)
    masters["model.norm.weight"][:4] = [np.nan, -np.inf, np.inf, _f32([0x7F800001])[0]]
    ro = masters["model.layers.2.mlp.up_proj.weight"].copy()
    ro.flags.writeable = False  # read-only: formats casts it
    masters["model.layers.2.mlp.up_proj.weight"] = ro
    cfg = PublisherConfig(format=fmt)
    expected = cast_view(masters, fmt)
    calls: list[int] = []
    cast = snapshot._torch_cast()
    assert cast is not None
    monkeypatch.setattr(
        cast, "host_words", lambda a, out=None: calls.append(a.size) or host_words(a, out)
    )
    for torch_on in (True, False):
        if not torch_on:
            monkeypatch.setattr(snapshot, "_torch_cast", lambda: None)
        view = snapshot.snapshot_served(masters, cfg)
        assert list(view) == list(expected) and view.metadata == expected.metadata
        for name, t in view.items():
            assert t.kind == expected[name].kind and t.shape == expected[name].shape, name
            assert np.array_equal(t.data, expected[name].data), name
            assert not any(np.shares_memory(t.data, m) for m in masters.values())
        if torch_on:
            assert calls, "the torch cast was not used"
    assert view["model.norm.weight"].data[0] == BF16_NAN


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_in_a_quantised_master_is_refused_as_before(value: float) -> None:
    """With torch in the process, NaN/inf in a quantised tensor still fails the version with
    formats' FormatError (the same message), and LATEST does not move."""
    bad = random_masters(4, n=1)
    bad["model.layers.0.mlp.up_proj.weight"][3, 5] = value
    with pytest.raises(FormatError) as direct:
        cast_view(bad, "fp8-e4m3")
    store = "memory://cast-refusal"
    pub = Publisher(store, RUN, PublisherConfig(format="fp8-e4m3"))
    try:
        pub.publish(bad)
        with pytest.raises(FormatError) as published:
            pub.flush()
        assert str(published.value) == str(direct.value)
    finally:
        pub.close()  # the error was raised by flush: close does not raise it again
        assert pub.board.latest(RUN) is None
        MemoryStore.reset("cast-refusal")
