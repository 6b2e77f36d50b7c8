"""The native core against its numpy reference: same bytes, same decodes, same digests.

``rp.ctxgolomb.v2`` has two implementations (rollpatch.native in C, rollpatch.patch.ctxv2 in
numpy); the format is what both write, so every property here is an equality between them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpatch import native
from rollpatch.errors import BaseMismatchError, PatchDecodeError, RollpatchError
from rollpatch.kinds import KINDS
from rollpatch.patch.codec_v2 import CtxGolombV2
from rollpatch.patch.ctxv2 import CHUNK
from rollpatch.patch.differ import changed_positions
from rollpatch.patch.ops import gather
from rollpatch.view import Tensor, _sum128_numpy, sum128
from tests.test_patch import SPECIAL_BF16, _perturb, _words

NATIVE, REF = CtxGolombV2(), CtxGolombV2(reference=True)


def test_native_core_is_built() -> None:
    """CI builds the extension from a clean checkout; a silent numpy fallback would hide it."""
    assert native.core is not None, "rollpatch.native._rpcore is not built: pip install -e ."


#: The numpy reference's payload for a pair of tensors it already encoded and decoded back
#: (see :func:`_both`), by the pair's contents: the tests that force each ISA level in turn
#: give the native core the same inputs, and the reference (pure numpy, no ISA) answers them
#: alike, so it is run once per input, not once per level.
_REFERENCE_CHECKED: dict[tuple[str, bytes], bytes] = {}


def _pair_key(t: Tensor, u: Tensor) -> tuple[str, bytes]:
    h = hashlib.sha1(repr((t.shape, u.shape)).encode(), usedforsecurity=False)  # SHA-NI: fast
    for x in (t, u):
        h.update(np.ascontiguousarray(x.data).view(np.uint8))
    return t.kind.name, h.digest()


def _both(t: Tensor, u: Tensor, *, reuse_reference: bool = False) -> bytes:
    """The native payload of ``t`` -> ``u``, checked against the numpy reference's bytes; both
    decode it to the changes. ``reuse_reference``: for inputs the reference has already
    encoded and decoded back, its payload is taken from that run."""
    ea, eb = t.elements(), u.elements()
    pos = np.flatnonzero(ea != eb).astype(np.int64)
    a = NATIVE.encode(t, pos, ea[pos], eb[pos])
    key = _pair_key(t, u) if reuse_reference else None
    checked = None if key is None else _REFERENCE_CHECKED.get(key)
    b = REF.encode(t, pos, ea[pos], eb[pos]) if checked is None else checked
    assert a == b, "native and numpy payloads differ"
    if pos.size:
        dense, k = NATIVE.encode_dense(t, u)
        assert (dense, k) == (a, pos.size), "fused native encoder differs"
        for codec in (NATIVE,) if checked is not None else (NATIVE, REF):
            p, o, n = codec.decode(memoryview(a), t, int(pos.size))
            assert np.array_equal(p, pos) and np.array_equal(o, ea[pos])
            assert np.array_equal(n, eb[pos]) and n.dtype == t.kind.elem_dtype
    if key is not None:
        _REFERENCE_CHECKED[key] = b
    return a


SIZES = [(n, d) for n in (1, 7, 1000, 65_536 + 17) for d in (0.0, 0.002, 0.4, 0.97, 1.0)]


@pytest.mark.parametrize("kind_name", sorted(KINDS))
@pytest.mark.parametrize(("n", "density"), SIZES + [(CHUNK + 3, 0.002), (CHUNK + 3, 0.4)])
def test_same_bytes_every_kind(kind_name: str, n: int, density: float) -> None:
    rng = np.random.default_rng(n + int(1000 * density))
    kind = KINDS[kind_name]
    words = n // 2 if kind.packed else n
    a = _words(rng, kind_name, max(words, 1))
    b = _perturb(rng, kind_name, a, density) if density < 1 else ~a
    _both(Tensor(kind, (a.size,), a), Tensor(kind, (b.size,), b.astype(kind.word_dtype)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    old=st.lists(st.sampled_from(SPECIAL_BF16) | st.integers(0, 0xFFFF), min_size=1, max_size=400),
    data=st.data(),
)
def test_bf16_specials_same_bytes(old: list[int], data: st.DataObject) -> None:
    """NaN payloads, ±0, subnormals, infinities: identical payloads and decodes."""
    new = [
        data.draw(st.sampled_from(SPECIAL_BF16) | st.integers(0, 0xFFFF) | st.just(x)) for x in old
    ]
    kind = KINDS["bf16"]
    t = Tensor(kind, (len(old),), np.array(old, dtype=np.uint16))
    _both(t, Tensor(kind, (len(new),), np.array(new, dtype=np.uint16)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind_name=st.sampled_from(sorted(KINDS)),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 3000),
    density=st.floats(0, 1),
)
def test_random_transitions_same_bytes(kind_name: str, seed: int, n: int, density: float) -> None:
    rng = np.random.default_rng(seed)
    kind = KINDS[kind_name]
    a = _words(rng, kind_name, n)
    b = _perturb(rng, kind_name, a, density)
    _both(Tensor(kind, (n,), a), Tensor(kind, (n,), b))


def test_context_model_on_big_bf16_is_identical() -> None:
    """65,536+ elements: contexts (exponents) are used; ranks cross the chunk boundary."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(CHUNK + 50_000) * 0.02).astype(np.float32)
    w2 = w + (2e-5 * rng.standard_normal(w.size)).astype(np.float32)
    kind = KINDS["bf16"]
    a = Tensor(kind, (w.size,), (w.view(np.uint32) >> 16).astype(np.uint16))
    b = Tensor(kind, (w.size,), (w2.view(np.uint32) >> 16).astype(np.uint16))
    blob = _both(a, b)
    assert len(blob) < 0.5 * int((a.data != b.data).sum()) * 2  # < 4 bits per change


def test_wrong_base_is_refused_by_both() -> None:
    rng = np.random.default_rng(5)
    kind = KINDS["bf16"]
    w = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    a = Tensor(kind, (w.size,), (w.view(np.uint32) >> 16).astype(np.uint16))
    b = Tensor(kind, (w.size,), _perturb(rng, "bf16", a.data, 0.01))
    pos = changed_positions(a, b)
    blob = NATIVE.encode(a, pos, gather(a, pos), gather(b, pos))
    other = Tensor(kind, (w.size,), _perturb(rng, "bf16", a.data, 0.2))
    for codec in (NATIVE, REF):
        with pytest.raises((BaseMismatchError, PatchDecodeError)):
            codec.decode(memoryview(blob), other, int(pos.size))


def test_corrupt_payloads_are_refused_cleanly() -> None:
    """Every truncation and many bit flips: a RollpatchError, never a crash or other error."""
    rng = np.random.default_rng(9)
    kind = KINDS["bf16"]
    w = (rng.standard_normal(70_000) * 0.02).astype(np.float32)
    a = Tensor(kind, (w.size,), (w.view(np.uint32) >> 16).astype(np.uint16))
    b = Tensor(kind, (w.size,), _perturb(rng, "bf16", a.data, 0.02))
    pos = changed_positions(a, b)
    blob = NATIVE.encode(a, pos, gather(a, pos), gather(b, pos))
    bad = [blob[:i] for i in range(0, len(blob), max(1, len(blob) // 300))]
    for _ in range(300):
        x = bytearray(blob)
        x[int(rng.integers(len(x)))] ^= 1 << int(rng.integers(8))
        bad.append(bytes(x))
    for x in bad:
        results = []
        for codec in (NATIVE, REF):
            try:
                p, _, n = codec.decode(memoryview(x), a, int(pos.size))
                results.append((p.tobytes(), n.tobytes()))
            except RollpatchError:
                results.append(None)
        assert results[0] == results[1], "native and numpy disagree on a corrupt payload"


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 33, 4096 + 5, (1 << 23) * 8 + 24])
def test_sum128_native_equals_numpy(nbytes: int) -> None:
    raw = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert sum128(raw) == _sum128_numpy(raw)


def test_sum128_detects_every_single_bit_flip_in_a_word() -> None:
    raw = np.random.default_rng(1).integers(0, 256, 64, dtype=np.uint8)
    base = sum128(raw)
    for bit in range(64 * 8):
        x = raw.copy()
        x[bit // 8] ^= 1 << (bit % 8)
        assert sum128(x) != base


def test_native_apply_checks_old_and_reports_the_digest_change() -> None:
    core = native.require()
    rng = np.random.default_rng(2)
    for kind_name in ("bf16", "e2m1x2", "u8", "f32"):
        kind = KINDS[kind_name]
        a = _words(rng, kind_name, 5000)
        b = _perturb(rng, kind_name, a, 0.05)
        ta, tb = Tensor(kind, (a.size,), a.copy()), Tensor(kind, (b.size,), b)
        pos = changed_positions(ta, tb)
        old, new = gather(ta, pos), gather(tb, pos)
        before = sum128(ta.data)
        with pytest.raises(BaseMismatchError):
            core.apply(native.kind_tuple(kind, 0), ta.data, pos, new, new)
        assert np.array_equal(ta.data, a), "a refused apply wrote something"
        da, db = core.apply(native.kind_tuple(kind, 0), ta.data, pos, old, new)
        assert np.array_equal(ta.data, b)
        m = (1 << 64) - 1
        assert sum128(ta.data) == ((before[0] + da) & m, (before[1] + db) & m)


@pytest.mark.parametrize("kind_name", ["bf16", "e2m1x2", "u8", "f32", "f64"])
@pytest.mark.parametrize("n", [1, 7, 5000])
def test_dry_apply_reports_the_change_and_writes_nothing(kind_name: str, n: int) -> None:
    """``apply(..., dry=True)`` (what staging proves with: the live words are only read) gives
    the same rp.sum128 change as the apply that writes, refuses the same bad old words, and
    leaves the words as they were, from a read-only buffer too; a write needs a writable one."""
    core = native.require()
    kind, rng = KINDS[kind_name], np.random.default_rng(n)
    a = _words(rng, kind_name, n)
    b = _perturb(rng, kind_name, a, 0.3)
    ta, tb = Tensor(kind, (a.size,), a.copy()), Tensor(kind, (b.size,), b)
    pos = changed_positions(ta, tb)
    old, new = gather(ta, pos), gather(tb, pos)
    kt = native.kind_tuple(kind, 0)
    frozen = ta.data.copy()
    frozen.flags.writeable = False
    dry = core.apply(kt, frozen, pos, old, new, True)
    assert np.array_equal(frozen, a)
    if pos.size:
        with pytest.raises(BaseMismatchError):
            core.apply(kt, frozen, pos, new, new, True)
        with pytest.raises(TypeError, match="read-only"):
            core.apply(kt, frozen, pos, old, new)
    assert core.apply(kt, ta.data, pos, old, new) == dry
    assert np.array_equal(ta.data, b)


@pytest.mark.parametrize("count", [2, 300, 5000])  # inside one read-back batch, and across
def test_apply_read_back_catches_a_write_that_changed_its_own_input(count: int) -> None:
    """``apply(..., readback=True)`` reads the written elements back as it goes: the same
    change as without it for a true update; where a later write changes what an earlier one
    wrote (the new words a view of the words written: aliasing), a CorruptError
    (:class:`PatchDecodeError`) with every element written put back."""
    core = native.require()
    kt = native.kind_tuple(KINDS["bf16"], 0)
    orig = np.random.default_rng(count).integers(0, 1 << 16, 2 * count + 8, dtype=np.uint16)
    orig[1::2] = orig[0::2] ^ 1  # neighbours always differ
    pos = np.arange(count, dtype=np.int64)
    old, new = orig[:count].copy(), orig[1 : count + 1].copy()
    t, u = orig.copy(), orig.copy()
    assert core.apply(kt, t, pos, old, new, False, True) == core.apply(kt, u, pos, old, new)
    assert np.array_equal(t, u)
    a = orig.copy()
    with pytest.raises(PatchDecodeError, match="read-back"):
        core.apply(kt, a, pos, old, a[1 : count + 1], False, True)
    assert np.array_equal(a, orig)


@pytest.mark.parametrize("kind_name", ["u8", "bf16", "f32", "f64"])
def test_native_apply_refuses_bad_positions_inside_a_word_and_past_the_tail(kind_name: str) -> None:
    """apply reads each 64-bit word once and takes every change in it; a position that repeats,
    goes back or passes the tensor's end inside that word (the tail word of an odd-sized
    tensor) is refused like any other, with nothing written; sparse positions (prefetched
    ahead) apply and gather like dense ones."""
    core = native.require()
    kind = KINDS[kind_name]
    per = 64 // kind.bits
    rng = np.random.default_rng(5)
    n = 3 * per + 1  # the last word holds one element
    a = _words(rng, kind_name, n)
    kt = native.kind_tuple(kind, 0)
    last = n - 1
    bad_lists = [
        [last, last + 1],  # past the end, in the tail word
        [1, 1],  # repeats inside one word
        [2, 1] if per > 2 else [per, 1],  # goes back (inside one word where it can)
        [0, -1],
        [last + per],
    ]
    for bad in bad_lists:
        pos = np.array(bad, np.int64)
        t = a.copy()
        held = np.array([t[p] if 0 <= p < n else 0 for p in bad], t.dtype)
        with pytest.raises(ValueError, match="out of range or not increasing"):
            core.apply(kt, t, pos, held, held ^ np.array(1, t.dtype))
        assert np.array_equal(t, a), f"a refused apply wrote something: {bad}"
        with pytest.raises(ValueError, match="out of range"):
            core.gather(kt, t, np.array([0, n], np.int64), np.empty(2, t.dtype))
    big = _words(rng, kind_name, 200_000)
    for count in (100, 50_000):  # sparse (prefetched) and dense
        pos = np.sort(rng.choice(big.size, count, replace=False)).astype(np.int64)
        new = _words(rng, kind_name, count)
        t = big.copy()
        got = np.empty(count, t.dtype)
        core.gather(kt, t, pos, got)
        assert np.array_equal(got, big[pos])
        core.apply(kt, t, pos, got, new)
        want = big.copy()
        want[pos] = new
        assert np.array_equal(t, want)


def test_records_path_gives_the_same_bytes() -> None:
    """Records computed elsewhere (as a trainer's device would) code to the same payload."""
    from rollpatch.patch.codec_v2 import ChunkRecords

    rng = np.random.default_rng(11)
    kind = KINDS["bf16"]
    w = (rng.standard_normal(CHUNK + 70_000) * 0.02).astype(np.float32)
    a = Tensor(kind, (w.size,), (w.view(np.uint32) >> 16).astype(np.uint16))
    b = Tensor(kind, (w.size,), _perturb(rng, "bf16", a.data, 0.01))
    chunks: list[ChunkRecords | None] = []
    for s in range(0, w.size, CHUNK):
        old, new = a.data[s : s + CHUNK], b.data[s : s + CHUNK]
        ctx = ((old >> 7) & 0xFF).astype(np.uint8)
        order = np.argsort(ctx, kind="stable")
        inv = np.empty(ctx.size, np.int64)
        inv[order] = np.arange(ctx.size)
        sizes = np.bincount(ctx, minlength=256)
        pos = np.flatnonzero(old != new)
        ranks = inv[pos] - (np.cumsum(sizes) - sizes)[ctx[pos]]
        chunks.append(ChunkRecords(sizes, pos, ctx[pos], ranks, old[pos], new[pos]))
    got = NATIVE.encode_records(kind, w.size, chunks)
    assert got == NATIVE.encode_dense(a, b)[0]
    bad = chunks[0]
    assert bad is not None
    broken = ChunkRecords(
        bad.sizes, bad.positions, bad.contexts, bad.ranks[::-1].copy(), bad.old, bad.new
    )
    with pytest.raises(ValueError):
        NATIVE.encode_records(kind, w.size, [broken] + chunks[1:])


@pytest.mark.parametrize("threads", ["1", "3"])
def test_encode_views_chunk_ranges_on_threads(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor's chunk ranges are jobs of one pool (largest first) and are put back in
    order: the bytes equal diff + encode with one thread or several, with tensors of several
    ranges (over 4 chunks), of one chunk, with no change and with nothing in a range."""
    from rollpatch.patch import diff, encode, encode_views
    from rollpatch.view import View

    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    rng = np.random.default_rng(5)
    a, b = {}, {}
    for name, n, kind, density in [
        ("big", 9 * CHUNK + 11, "bf16", 0.003),
        ("mid", 5 * CHUNK, "e4m3", 0.02),
        ("small", 1000, "bf16", 0.1),
        ("same", 3000, "e2m1x2", 0.0),
        ("tail", 6 * CHUNK + 5, "bf16", 0.0),
    ]:
        k = KINDS[kind]
        w = rng.integers(0, 1 << 8 * k.word_dtype.itemsize, n // (2 if k.packed else 1))
        x = w.astype(k.word_dtype)
        y = x.copy()
        hit = rng.random(x.size) < density
        y[hit] ^= (rng.integers(1, 4, int(hit.sum()))).astype(k.word_dtype)
        if name == "tail":  # changes in the last range only
            y[-100:] ^= 1
        a[name], b[name] = Tensor(k, (x.size,), x), Tensor(k, (y.size,), y)
    va, vb = View(a), View(b)
    assert encode_views(va, vb) == encode(diff(va, vb), va)


@pytest.mark.parametrize("seed", [0, 1])
def test_encode_views_equals_encode_of_diff(seed: int) -> None:
    """The fused one-pass encoder writes the same bytes as diff + encode, ops of every kind."""
    from rollpatch.patch import diff, encode, encode_views
    from rollpatch.view import View
    from tests.patchfix import sample_views

    a, b = sample_views(seed=seed, n=200_000)
    b = View(dict(b))
    b["model.dense"] = Tensor(KINDS["u8"], (70_000,), np.arange(70_000, dtype=np.uint8))
    a = View(dict(a))
    a["model.dense"] = Tensor(KINDS["u8"], (70_000,), np.zeros(70_000, dtype=np.uint8))
    a["model.gone"] = Tensor(KINDS["bf16"], (3,), np.ones(3, dtype=np.uint16))
    assert encode_views(a, b) == encode(diff(a, b), a)
    # the same pass can hand back its changes: the patch diff builds, tensor for tensor
    from rollpatch.patch import encode_views_patch

    b["model.new"] = Tensor(KINDS["e4m3"], (5, 7), np.arange(35, dtype=np.uint8))
    blob, patch = encode_views_patch(a, b, meta={"k": "v"})
    want = diff(a, b)
    assert blob == encode_views(a, b, meta={"k": "v"}) and patch.equals(want)
    assert {n: t.op for n, t in patch.tensors.items()} == {n: t.op for n, t in want.tensors.items()}
    assert {"drop", "full", "delta"} <= {t.op for t in patch.tensors.values()}
    for name, tp in patch.tensors.items():
        if tp.op == "delta":
            got, exp = tp.changes(), want.tensors[name].changes()
            assert got.old.dtype == exp.old.dtype and got.positions.dtype == exp.positions.dtype


def test_apply_rehashes_by_default_and_incremental_is_exact_for_what_it_wrote() -> None:
    """Default apply re-hashes touched tensors: a flip outside the patch is caught and rolled
    back. ``incremental=True`` updates digests in O(change): the same digests when memory is
    intact, blind to the flip (that is what a background audit is for)."""
    from rollpatch.errors import TargetMismatchError
    from rollpatch.patch import apply, diff
    from tests.patchfix import sample_views

    a, b = sample_views(seed=4, n=200_000)
    p = diff(a, b)
    x = a.copy()
    apply(x, p, incremental=True)
    assert x.digest() == b.digest()
    x.invalidate()
    assert x.digest() == b.digest()
    tp = p.tensors["model.w"]
    spot = int(np.setdiff1d(np.arange(100), tp.changes().positions)[0])
    y = a.copy()
    y["model.w"].data[spot] ^= 1  # behind the cached digests' back
    with pytest.raises(TargetMismatchError):
        apply(y, p)
    z = a.copy()
    z["model.w"].data[spot] ^= 1
    apply(z, p, incremental=True)  # not detected here: the audit's job
    z.invalidate()
    assert z.digest() != b.digest()


def test_join_release_concatenates_and_releases_each_part() -> None:
    core = native.require()
    parts: list[object] = [b"ab", bytearray(b"cd"), memoryview(b"xyz")[1:], b""]
    assert core.join_release(parts) == b"abcdyz"
    assert parts == [None, None, None, None]
    assert core.join_release([]) == b""
    with pytest.raises(TypeError):
        core.join_release([b"ok", 3])


def test_compose_native_matches_the_numpy_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollpatch.patch import compose, diff
    from rollpatch.view import View

    rng = np.random.default_rng(7)
    kind = KINDS["bf16"]
    a = rng.integers(0, 1 << 16, 50_000, dtype=np.uint16)
    b, c = a.copy(), a.copy()
    b[rng.choice(a.size, 900, replace=False)] ^= 3
    c[:] = b
    c[rng.choice(a.size, 700, replace=False)] ^= 5
    c[rng.choice(a.size, 50, replace=False)] = a[:50]  # some changes undone
    va, vb, vc = (View({"w": Tensor(kind, (a.size,), x)}) for x in (a, b, c))
    p, q = diff(va, vb), diff(vb, vc)
    fast = compose(p, q)
    monkeypatch.setattr(native, "core", None)
    slow = compose(p, q)
    assert fast.tensors.keys() == slow.tensors.keys()
    for name in fast.tensors:
        assert fast.tensors[name].equals(slow.tensors[name])
    assert fast.tensors["w"].equals(diff(va, vc).tensors["w"])
