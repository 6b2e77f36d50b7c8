"""The fused decode+apply (``apply_encoded``) against ``apply(view, decode(blob, view))``:
the same words, digests and error classes, and all or nothing on every failure."""

from __future__ import annotations

import numpy as np
import pytest

from rollpatch.errors import BaseMismatchError, RollpatchError, TargetMismatchError
from rollpatch.kinds import KINDS
from rollpatch.patch import apply, apply_encoded, decode, diff, encode, encode_views
from rollpatch.patch.ctxv2 import CHUNK
from rollpatch.view import Tensor, View, sum128
from tests.patchfix import reseal, sample_views, split_blob


def _views(seed: int) -> tuple[View, View]:
    a, b = sample_views(seed=seed, n=3_158_000)  # several chunks per tensor
    assert a["model.w"].n_elements > 3 * CHUNK
    a, b = View(dict(a)), View(dict(b))
    a["model.gone"] = Tensor(KINDS["bf16"], (3,), np.ones(3, dtype=np.uint16))
    b["model.new"] = Tensor(KINDS["int4x2"], (4, 4), np.arange(16, dtype=np.uint8))
    return a, b


def _same_words(x: View, y: View) -> bool:
    return set(x) == set(y) and all(np.array_equal(x[n].data, y[n].data) for n in x)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("threads", ["1", "3"])
def test_same_result_as_apply_of_decode(
    seed: int, incremental: bool, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one thread tensor after tensor; on several, tensors decoded and written at once."""
    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    a, b = _views(seed)
    blob = encode_views(a, b)
    x, y = a.copy(), a.copy()
    apply(x, decode(blob, x), incremental=incremental)
    apply_encoded(y, blob, incremental=incremental)
    assert _same_words(x, b) and _same_words(y, b)
    assert y.digest() == b.digest()
    y.invalidate()
    assert y.digest() == b.digest()


def test_version_1_patches_go_through_the_decoder() -> None:
    a, b = _views(2)
    blob = encode(diff(a, b, digest="rp.blake3.v1"), a, version=1)
    y = a.copy()
    apply_encoded(y, blob)
    assert _same_words(y, b)


def test_wrong_base_is_refused_before_anything_is_written() -> None:
    a, b = _views(3)
    blob = encode_views(a, b)
    c = b.copy()
    with pytest.raises(BaseMismatchError):
        apply_encoded(c, blob)
    assert _same_words(c, b)


@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_corrupt_later_chunk_leaves_every_word_in_place(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first chunks of a tensor decode and are written; a later one is corrupt: the
    written chunks are put back (and so is every other tensor, also those written at the
    same time on other threads)."""
    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    a, b = _views(4)
    blob = encode_views(a, b)
    header, payload = split_blob(blob)
    e = next(t for t in header["tensors"] if t["name"] == "model.w")
    body = bytearray(payload)
    end = e["offset"] + e["length"]
    body[end - 3] ^= 0x5A  # inside the last chunk's streams
    bad = reseal(header, bytes(body))
    for fn in (lambda v, blob: apply(v, decode(blob, v)), apply_encoded):
        v = a.copy()
        before = a.digest()
        with pytest.raises(RollpatchError):
            fn(v, bad)
        assert _same_words(v, a)
        v.invalidate()
        assert v.digest() == before


@pytest.mark.parametrize("lie", ["beyond-the-tensor", "one-short", "one-more", "not-an-int"])
@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_false_changed_count_is_refused_as_decode_refuses_it(
    lie: str, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apply_encoded sizes one set of output arrays for all v2 deltas from the headers'
    counts (inplace._share_outputs): a count beyond its tensor is never allocated for, and
    any false count is refused with the error class decode gives, every word in place."""
    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    a, b = _views(6)
    header, payload = split_blob(encode_views(a, b))
    e = next(t for t in header["tensors"] if t["name"] == "model.w")
    e["changed"] = {
        "beyond-the-tensor": a["model.w"].n_elements + 1,
        "one-short": e["changed"] - 1,
        "one-more": e["changed"] + 1,
        "not-an-int": float(e["changed"]),
    }[lie]
    bad = reseal(header, payload)
    raised = []
    for fn in (lambda v, blob: apply(v, decode(blob, v)), apply_encoded):
        v = a.copy()
        with pytest.raises(RollpatchError) as err:
            fn(v, bad)
        raised.append(type(err.value))
        assert _same_words(v, a)
    assert raised[0] is raised[1]


def test_a_flip_behind_the_digests_back_is_caught_by_the_full_check_only() -> None:
    a, b = _views(5)
    blob = encode_views(a, b)
    p = decode(blob, a)
    tp = p.tensors["model.w"]
    spot = int(np.setdiff1d(np.arange(1000), tp.changes().positions)[0])
    v = a.copy()
    v["model.w"].data[spot] ^= 1  # memory changed, cached digests not
    with pytest.raises(RollpatchError):
        apply_encoded(v, blob)
    assert v["model.w"].data[spot] == a["model.w"].data[spot] ^ 1  # nothing else written
    w = a.copy()
    w["model.w"].data[spot] ^= 1
    apply_encoded(w, blob, incremental=True)  # O(change) digests cannot see it: the audit's job
    w.invalidate()
    assert w.digest() != b.digest()


@pytest.mark.parametrize("lie", ["tensor", "root"])
@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_false_target_puts_every_tensor_back_with_its_digests(
    lie: str, incremental: bool, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A patch of v2 deltas only (checked after the one native write of all of them): a
    false target digest, of a tensor or the root, is refused after the writes; every word is
    put back and the view's cached digests and sums are its base's again, so the right patch
    applies next."""
    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    a, b = _views(7)
    a, b = View({n: a[n] for n in a if n in b}), View({n: b[n] for n in a if n in b})
    blob = encode_views(a, b)
    header, payload = split_blob(blob)
    assert all(e["codec"] == "rp.ctxgolomb.v2" for e in header["tensors"])
    if lie == "tensor":
        header["tensors"][-1]["target"] = "0" * 64
    else:
        header["target"] = "0" * 64
    v = a.copy()
    v.digest()
    with pytest.raises(TargetMismatchError):
        apply_encoded(v, reseal(header, payload), incremental=incremental)
    assert _same_words(v, a)
    assert v.digest() == a.digest()
    assert all(v.cached_sum_state(n) in (None, sum128(a[n].data)) for n in a)
    apply_encoded(v, blob, incremental=incremental)
    assert _same_words(v, b) and v.digest() == b.digest()
    v.invalidate()
    assert v.digest() == b.digest()


def test_encode_views_derives_the_new_digests_from_the_old_state_exactly() -> None:
    """The encoder compares every word, so sum128(b) = sum128(a) + the change it summed over
    the changed words; equal to a full re-hash of b for every kind."""
    a, b = _views(6)
    a.digest()
    b.invalidate()
    encode_views(a, b)
    for name in b:
        st = b.cached_sum_state(name)
        if name in a and st is not None:
            assert st == sum128(b[name].data), name


def test_encode_views_carries_the_digests_of_unchanged_tensors() -> None:
    """An unchanged tensor's state and digest are the base's (carried, not derived again),
    a changed one's digest follows from its derived state; each equals a full re-hash."""
    a, b = _views(6)
    same = "model.same"
    words = np.arange(1 << 17, dtype=np.uint16)
    a[same], b[same] = (
        Tensor(KINDS["bf16"], (words.size,), words),
        Tensor(KINDS["bf16"], (words.size,), words.copy()),
    )
    a.digest()
    b.invalidate()
    encode_views(a, b)
    assert b.cached_sum_state(same) == a.cached_sum_state(same)
    carried = b.tensor_digests()
    root = b.digest()
    b.invalidate()
    assert b.tensor_digests() == carried and b.digest() == root
    assert carried[same] == a.tensor_digest(same)


@pytest.mark.parametrize("kind", ["bf16", "e4m3", "e2m1x2", "int4x2", "f32", "u8", "i64"])
@pytest.mark.parametrize("threads", ["1", "3"])
def test_the_in_pass_hash_equals_a_rehash_after_the_write(
    kind: str, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``decode_into_hashed`` sums every word as it reads it (chunks without a change too)
    plus the change it wrote: exactly sum128 of the tensor after the write, for every kind,
    odd lengths (a zero-padded last word) and chunk ranges on several threads."""
    from rollpatch.patch.codec_v2 import CtxGolombV2

    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    k = KINDS[kind]
    rng = np.random.default_rng(7)
    words = 3 * CHUNK + 12_345 if not k.packed else (3 * CHUNK + 12_345) // 2
    info = np.iinfo(k.word_dtype)
    old = rng.integers(0, int(info.max) + 1, size=words, dtype=np.uint64).astype(k.word_dtype)
    new = old.copy()
    hit = rng.random(words) < 0.01
    hit[CHUNK // (2 if k.packed else 1) : 2 * CHUNK // (2 if k.packed else 1)] = False
    new[hit] ^= 1  # one chunk without a change: hashed all the same
    a = View({"t": Tensor(k, (words,), old.copy())})
    b = View({"t": Tensor(k, (words,), new)})
    blob = encode_views(a, b)
    header, payload = split_blob(blob)
    e = header["tensors"][0]
    assert e["codec"] == "rp.ctxgolomb.v2"
    body = memoryview(payload)[e["offset"] : e["offset"] + e["length"]]
    t = a["t"]
    _, _, _, change, state = CtxGolombV2().decode_into_hashed(body, t, e["changed"])
    assert np.array_equal(t.data, new)
    assert state == sum128(new)
    assert change != (0, 0)


@pytest.mark.parametrize("kind", ["bf16", "e4m3"])
@pytest.mark.parametrize("density", [0.003, 0.02, 0.3])
def test_incremental_sums_match_a_full_rehash_with_shared_words(kind: str, density: float) -> None:
    """The O(change) sums of the in-place write (16 changes at a time with AVX-512, one
    gather per 8): changes that share a 64-bit word, runs of them across the 8- and
    16-change steps, and a last word that the tensor only partly fills; the incremental
    digest equals a full re-hash of the words written."""
    k = KINDS[kind]
    rng = np.random.default_rng(int(density * 1000))
    n = 3 * CHUNK // 2 + 5  # a partial last word
    dt = np.uint16 if k.bits == 16 else np.uint8
    old = rng.integers(0, 1 << k.bits, n, dtype=np.uint64).astype(dt)
    if k.bits == 8:
        old &= 0x77  # finite, no NaN codes
    else:
        old &= 0x3FFF
    new = old.copy()
    hit = rng.random(n) < density
    hit[-7:] = True  # the last, partial word
    hit[1000:1040] = True  # one run of whole words across several steps
    new[hit] = (new[hit] + rng.integers(1, 3, int(hit.sum()))).astype(dt)
    a = View({"w": Tensor(k, (n,), old)})
    b = View({"w": Tensor(k, (n,), new)})
    a.digest()
    blob = encode_views(a, b)
    y = a.copy()
    y.digest()
    apply_encoded(y, blob, incremental=True)  # the target digest is checked from the sums
    assert _same_words(y, b)
    state = y.cached_sum_state("w")
    assert state is None or state == sum128(new)
    y.invalidate()
    assert y.digest() == b.digest()


@pytest.mark.parametrize("threads", ["1", "3"])
def test_output_arrays_are_reused_only_after_a_verified_apply(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arrays of a verified apply are kept (spare) and serve the next one, which gives
    the same words; a failed apply's are not kept (its undo read them), and with no room
    (``set_max_bytes(0)``) nothing is kept."""
    from rollpatch.patch import spare

    monkeypatch.setenv("ROLLPATCH_THREADS", threads)
    monkeypatch.setattr(spare, "_spare", {})
    a, b = _views(8)
    a, b = View({n: a[n] for n in a if n in b}), View({n: b[n] for n in a if n in b})
    blob = encode_views(a, b)
    header, payload = split_blob(blob)
    header["target"] = "0" * 64
    lie = reseal(header, payload)
    v = a.copy()
    apply_encoded(v, blob)
    kept = dict(spare._spare)
    assert kept and kept["pos"].size >= sum(e["changed"] for e in header["tensors"])
    v = a.copy()
    apply_encoded(v, blob)  # the same arrays again
    assert _same_words(v, b) and all(spare._spare[k] is x for k, x in kept.items())
    v = a.copy()
    with pytest.raises(TargetMismatchError):
        apply_encoded(v, lie)
    assert _same_words(v, a) and not spare._spare  # taken, written, put back, not kept
    apply_encoded(v, blob)
    assert _same_words(v, b) and v.digest() == b.digest()
    try:
        spare.set_max_bytes(0)
        assert not spare._spare
        apply_encoded(a.copy(), blob)
        assert not spare._spare
    finally:
        spare.set_max_bytes(256 << 20)
    with pytest.raises(ValueError, match="max bytes"):
        spare.set_max_bytes(-1)
