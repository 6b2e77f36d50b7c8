"""Losslessness and verification of the patch codec, as properties over every element kind."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpatch.engines.catchup import Changes
from rollpatch.errors import BaseMismatchError, PatchError, TargetMismatchError
from rollpatch.kinds import KINDS
from rollpatch.patch import apply, apply_bytes, compose, decode, diff, encode, inspect
from rollpatch.patch.differ import changes
from rollpatch.patch.groups import MIN_CONTEXT_ELEMENTS
from rollpatch.view import Tensor, View

SPECIAL_BF16 = [
    0x0000,
    0x8000,
    0x7F80,
    0xFF80,
    0x7FC0,
    0xFFC1,
    0x7F81,
    0x0001,
    0x8001,
    0x007F,
    0x3F80,
    0xBF80,
    0x7F7F,
    0xFF7F,
]


def _words(rng: np.random.Generator, kind_name: str, n: int) -> np.ndarray:
    kind = KINDS[kind_name]
    nbytes = kind.word_dtype.itemsize
    if kind_name in ("bf16", "f32", "f16"):
        w = (rng.standard_normal(n) * 0.02).astype(np.float32)
        if kind_name == "f32":
            return w.view(np.uint32)
        if kind_name == "f16":
            return w.astype(np.float16).view(np.uint16)
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    raw = rng.integers(0, 256, n * nbytes, dtype=np.uint8)
    return raw.view(kind.word_dtype)


def _perturb(
    rng: np.random.Generator, kind_name: str, words: np.ndarray, density: float
) -> np.ndarray:
    kind = KINDS[kind_name]
    out = words.copy()
    n = words.size
    k = int(n * density)
    if k == 0:
        return out
    idx = rng.choice(n, size=k, replace=False)
    step = rng.choice([1, -1, 1, -1, 2, -3, 1000], size=k).astype(np.int64)
    out[idx] = out[idx] + step.astype(kind.word_dtype)  # wraps modulo the word width
    return out


def _view(kind_name: str, words: np.ndarray) -> View:
    return View({"t": Tensor(KINDS[kind_name], (words.size,), words)})


def _roundtrip(a: View, b: View) -> None:
    p = diff(a, b)
    blob = encode(p, a)
    q = decode(blob, a)
    assert q.equals(p)
    out = apply(a, q, inplace=False)
    assert out.digest() == b.digest()
    for name in b:
        assert np.array_equal(out[name].data, b[name].data)


@pytest.mark.parametrize("kind_name", sorted(KINDS))
@pytest.mark.parametrize("n", [0, 1, 7, 1000, MIN_CONTEXT_ELEMENTS + 4097])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 0.9])
def test_roundtrip_every_kind(kind_name: str, n: int, density: float) -> None:
    rng = np.random.default_rng(n + int(density * 100))
    a = _words(rng, kind_name, n)
    b = _perturb(rng, kind_name, a, density)
    _roundtrip(_view(kind_name, a), _view(kind_name, b))


@pytest.mark.parametrize("kind_name", sorted(KINDS))
@pytest.mark.parametrize("n", [0, 1, 33, 70_001])
def test_changes_are_the_differing_elements_of_both(kind_name: str, n: int) -> None:
    """``differ.changes`` (the words taken in the native compare's pass, or gathered after it for
    4-bit codes) = numpy's positions and elements, words compared as words (NaN, -0)."""
    rng = np.random.default_rng(n + len(kind_name))
    kind = KINDS[kind_name]
    words = max(n // 2, 1) if kind.packed else n
    a = _words(rng, kind_name, words)
    b = _perturb(rng, kind_name, a, 0.2)
    if kind_name == "bf16" and n > 1:
        a[:2], b[:2] = (0x7FC0, 0x8000), (0x7FC1, 0x0000)  # NaN to NaN, -0 to +0: changes
    ta, tb = Tensor(kind, (a.size,), a), Tensor(kind, (b.size,), b)
    ea, eb = ta.elements(), tb.elements()
    want = np.flatnonzero(ea != eb)
    arena = Changes()  # the catch-up's: rooms in arena blocks, trimmed in place
    for got in (changes(ta, tb), changes(ta, tb, empty=arena.empty, trim=arena.trim)):
        pos, old, new = got
        assert pos.dtype == np.int64 and np.array_equal(pos, want)
        assert np.array_equal(old, ea[want]) and np.array_equal(new, eb[want])
        assert old.dtype == new.dtype == kind.elem_dtype


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    old=st.lists(st.sampled_from(SPECIAL_BF16) | st.integers(0, 0xFFFF), max_size=300),
    data=st.data(),
)
def test_bf16_specials_property(old: list[int], data: st.DataObject) -> None:
    """NaN payloads, ±0, subnormals and infinities survive any transition bit for bit."""
    new = [
        data.draw(st.sampled_from(SPECIAL_BF16) | st.integers(0, 0xFFFF) | st.just(x)) for x in old
    ]
    a = _view("bf16", np.array(old, dtype=np.uint16))
    b = _view("bf16", np.array(new, dtype=np.uint16))
    _roundtrip(a, b)


@settings(max_examples=40, deadline=None)
@given(
    kind_name=st.sampled_from(sorted(KINDS)),
    seed=st.integers(0, 2**32 - 1),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
)
def test_odd_shapes_property(kind_name: str, seed: int, shape: list[int]) -> None:
    rng = np.random.default_rng(seed)
    kind = KINDS[kind_name]
    n = int(np.prod(shape)) if shape else 1
    a = _words(rng, kind_name, n)
    b = _perturb(rng, kind_name, a, 0.5)
    ta, tb = Tensor(kind, tuple(shape), a), Tensor(kind, tuple(shape), b)
    _roundtrip(View({"x": ta}), View({"x": tb}))


def test_big_bf16_context_model_and_exponent_dependence() -> None:
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(1 << 20) * 0.02).astype(np.float32)
    w2 = w + (3e-6 * rng.standard_normal(w.size)).astype(np.float32)
    to16 = lambda x: Tensor.from_array(x.astype(np.float32)).data
    import ml_dtypes

    a = View({"w": Tensor.from_array(w.astype(ml_dtypes.bfloat16))})
    b = View({"w": Tensor.from_array(w2.astype(ml_dtypes.bfloat16))})
    del to16
    _roundtrip(a, b)


def test_structural_changes_full_and_drop() -> None:
    rng = np.random.default_rng(2)
    a = View(
        {
            "keep": Tensor(KINDS["bf16"], (10,), _words(rng, "bf16", 10)),
            "gone": Tensor(KINDS["f32"], (3,), _words(rng, "f32", 3)),
            "reshaped": Tensor(KINDS["u8"], (4,), _words(rng, "u8", 4)),
        }
    )
    b = View(
        {
            "keep": Tensor(KINDS["bf16"], (10,), _perturb(rng, "bf16", a["keep"].data, 0.3)),
            "new": Tensor(KINDS["e4m3"], (2, 3), _words(rng, "e4m3", 6)),
            "reshaped": Tensor(KINDS["u8"], (2, 3), _words(rng, "u8", 6)),
        }
    )
    p = diff(a, b)
    assert {n: t.op for n, t in p.tensors.items()} == {
        "keep": "delta",
        "gone": "drop",
        "new": "full",
        "reshaped": "full",
    }
    _roundtrip(a, b)


def _chain(seed: int) -> list[View]:
    rng = np.random.default_rng(seed)
    w = _words(rng, "bf16", 200_000)
    views = [w]
    for _ in range(3):
        views.append(_perturb(rng, "bf16", views[-1], 0.01))
    return [
        View(
            {
                "w": Tensor(KINDS["bf16"], (v.size,), v),
                "s": Tensor(KINDS["e2m1x2"], (50,), (v[:50] & 0xFF).astype(np.uint8)),
            }
        )
        for v in views
    ]


def test_compose_equals_direct_diff() -> None:
    a, b, c, d = _chain(3)
    pab, pbc, pcd = diff(a, b), diff(b, c), diff(c, d)
    assert compose(pab, pbc).equals(diff(a, c))
    assert compose(compose(pab, pbc), pcd).equals(diff(a, d))
    assert compose(pab, compose(pbc, pcd)).equals(diff(a, d))
    assert compose(pab, pab.inverse()).tensors == {}


def test_compose_rejects_non_chaining() -> None:
    a, b, c, _ = _chain(4)
    with pytest.raises(PatchError):
        compose(diff(a, b), diff(a, c))


def test_inverse_restores_previous() -> None:
    a, b, _, _ = _chain(5)
    p = diff(a, b)
    x = apply(a, p, inplace=False)
    apply(x, p.inverse())
    assert x.digest() == a.digest()


def test_wrong_base_is_refused_and_nothing_written() -> None:
    a, b, c, _ = _chain(6)
    p = diff(b, c)
    before = a["w"].data.copy()
    with pytest.raises(BaseMismatchError):
        apply(a, p)
    assert np.array_equal(a["w"].data, before)
    with pytest.raises(BaseMismatchError):
        decode(encode(p, b), a)


def test_target_mismatch_rolls_back() -> None:
    a, b, _, _ = _chain(7)
    p = diff(a, b)
    tp = p.tensors["w"]
    bad_new = tp.changes().new.copy()
    bad_new[0] ^= 1
    bad_tp = dataclasses.replace(tp, change=dataclasses.replace(tp.changes(), new=bad_new))
    bad = type(p)(p.base, p.target, {**p.tensors, "w": bad_tp})
    before = {n: t.data.copy() for n, t in a.items()}
    digest = a.digest()
    with pytest.raises(TargetMismatchError):
        apply(a, bad)
    assert a.digest() == digest
    for n, t in a.items():
        assert np.array_equal(t.data, before[n])
    a.invalidate()
    assert a.digest() == digest


def test_stale_digest_cache_caught_by_old_elements() -> None:
    a, b, _, _ = _chain(8)
    p = diff(a, b)
    x = a.copy()
    tp = p.tensors["w"]
    x["w"].data[tp.changes().positions[0]] ^= 1  # mutate behind the cache's back
    x.set_digest("w", a.tensor_digest("w"))
    with pytest.raises(BaseMismatchError):
        apply(x, p)
    with pytest.raises(BaseMismatchError):
        apply(x, p, verify=True)


def test_apply_bytes_and_inspect() -> None:
    a, b, _, _ = _chain(9)
    blob = encode(diff(a, b), a)
    info = inspect(blob)
    assert info.base == a.digest() and info.target == b.digest()
    assert info.n_changed == diff(a, b).n_changed
    x = a.copy()
    apply_bytes(x, blob)
    assert x.digest() == b.digest()


def test_patch_much_smaller_than_xor_zstd_on_sparse_bf16() -> None:
    import zstandard

    rng = np.random.default_rng(10)
    w = (rng.standard_normal(1 << 20) * 0.02).astype(np.float32)
    import ml_dtypes

    a = View({"w": Tensor.from_array(w.astype(ml_dtypes.bfloat16))})
    w2 = w + (1e-6 * rng.standard_normal(w.size)).astype(np.float32)
    b = View({"w": Tensor.from_array(w2.astype(ml_dtypes.bfloat16))})
    blob = encode(diff(a, b), a)
    xz = zstandard.ZstdCompressor(level=3).compress((a["w"].data ^ b["w"].data).tobytes())
    assert len(blob) < 0.6 * len(xz)


def test_header_json_is_one_dumps_of_the_whole_header() -> None:
    """The container's header is written 32 entries at a time (``header._header_json``): the same
    bytes as one ``json.dumps`` of the whole header, escapes, empty lists and group edges included."""
    import json

    from rollpatch.patch.header import _header_json

    head = {"format": "rollpatch.patch", "version": 2, "base": "a", "meta": {"k": 'v\u00e9"\n'}}
    many = [{"name": f"t{i}", "changed": i} for i in range(70)]  # groups of 32 and a rest
    for entries in ([], [{"name": "w\u2603", "shape": [1, 2], "base": None}], many, many[:64]):
        want = json.dumps({**head, "tensors": entries}, separators=(",", ":")).encode()
        assert _header_json(head, entries) == want
