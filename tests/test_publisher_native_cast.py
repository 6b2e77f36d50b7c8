"""The publisher's native BF16 cast (``native/rp_cast.c``, ``publisher/cast.py``): one pass that
rounds each float32 in registers, stores the word and compares it with the previous snapshot's.

Every instruction-set level must give formats' words (NaN → 0xFFFF, ±inf and subnormals kept,
ties to even) and exactly the differences a plain compare finds, wherever they lie (vector
body, masked or scalar tail, a cap that cuts the list). A publisher that takes the step's
changes from the cast must write the same objects, byte for byte, as one whose encoder finds
them, and must fall back to the encoder whenever the cast compared with another base."""

from __future__ import annotations

import uuid
import weakref

import numpy as np
import pytest

from rollpatch import native
from rollpatch.board import Board
from rollpatch.errors import BoardError
from rollpatch.formats import cast_view
from rollpatch.formats.floats import f32_to_bf16_bits
from rollpatch.patch import diff, encode_views, inspect
from rollpatch.publisher import Publisher, PublisherConfig, cast
from rollpatch.publisher.wordpool import WordPool
from rollpatch.store import MemoryStore
from tests.pubfix import RUN, SlowStore, check_all, copy_masters, nudge, random_masters
from tests.test_publisher_device import SPECIAL

pytestmark = pytest.mark.skipif(native.core is None, reason="the native core is not built")

NANS = [0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF]
LEVELS = [lvl for lvl in native.ISAS if lvl in ("scalar", "avx2", "avx512")]


@pytest.fixture(params=LEVELS)
def level(request: pytest.FixtureRequest) -> object:
    used, _ = native.isa(request.param)
    if used != request.param:
        native.isa(None)
        pytest.skip(f"this CPU does not run {request.param}")
    yield request.param
    native.isa(None)


def _bits(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)  # NaNs and subnormals too
    special = np.array(SPECIAL + NANS, np.uint32)
    x[: min(n, special.size)] = special[: min(n, special.size)]
    return x


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 33, 1000, 70_001])
def test_cast_is_formats_words_at_every_level(level: str, n: int) -> None:
    x = _bits(n, n)
    out = np.full(n, 0x1234, np.uint16)
    nans = native.core.cast_bf16(x, out)
    assert np.array_equal(out, f32_to_bf16_bits(x.view(np.float32)))
    assert nans == int(np.isnan(x.view(np.float32)).sum())


@pytest.mark.parametrize("n", [1, 16, 17, 33, 4099, 70_001])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_cast_diff_lists_exactly_the_differences(level: str, n: int, density: float) -> None:
    rng = np.random.default_rng(n)
    x = _bits(n + 7, n)
    words = f32_to_bf16_bits(x.view(np.float32))
    prev = words.copy()
    flip = rng.random(n) < density
    prev[flip] ^= rng.integers(1, 1 << 16, int(flip.sum()), dtype=np.uint32).astype(np.uint16)
    want = np.flatnonzero(words != prev)
    for cap in sorted({0, 1, want.size // 2, want.size, n}):
        out = np.empty(n, np.uint16)
        pos, old, new = np.empty(cap, np.int64), np.empty(cap, np.uint16), np.empty(cap, np.uint16)
        k, nans = native.core.cast_bf16_diff(x, prev, out, pos, old, new)
        assert np.array_equal(out, words) and k == want.size
        assert nans == int(np.isnan(x.view(np.float32)).sum())
        q = min(k, cap)  # only cap of them listed
        assert np.array_equal(pos[:q], want[:q])
        assert np.array_equal(old[:q], prev[want[:q]]) and np.array_equal(new[:q], words[want[:q]])


def test_cast_refuses_bad_buffers() -> None:
    x = np.ones(64, np.float32)
    with pytest.raises(ValueError, match="one uint16"):
        native.core.cast_bf16(x, np.empty(63, np.uint16))
    with pytest.raises(ValueError, match="overlap"):
        native.core.cast_bf16(x, x.view(np.uint16)[:64])
    prev, out = np.zeros(64, np.uint16), np.empty(64, np.uint16)
    pos, old = np.empty(8, np.int64), np.empty(8, np.uint16)
    with pytest.raises(ValueError, match="as long"):
        native.core.cast_bf16_diff(x, prev, out, pos, old, np.empty(7, np.uint16))
    with pytest.raises(ValueError, match="overlap"):
        native.core.cast_bf16_diff(x, out, out, pos, old, np.empty(8, np.uint16))
    with pytest.raises(ValueError, match="overlap"):
        native.core.cast_bf16_diff(x, prev, out, pos, old, old)


def test_host_words_without_the_native_core_is_the_torch_cast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    x = _bits(3, 5000).view(np.float32)
    monkeypatch.setattr(native, "core", None)
    out = np.empty(x.size, np.uint16)
    assert cast.host_words(x, out) is out
    assert np.array_equal(out, f32_to_bf16_bits(x))


def _masters(seed: int) -> dict[str, np.ndarray]:
    m = random_masters(seed, n=3)
    m["big"] = (np.random.default_rng(seed).standard_normal(cast._RANGE + 77) * 0.02).astype(
        np.float32
    )  # cut into two ranges (two jobs on the threads)
    return m


def test_snapshot_native_is_the_cast_and_its_step_is_the_diff() -> None:
    cfg = PublisherConfig(format="bf16")
    pool = WordPool()
    masters = _masters(1)
    masters["model.norm.weight"][:3] = [np.nan, -np.inf, 1e-40]
    first = cast.snapshot_native(masters, cfg, pool)
    assert first is not None and first.step is None
    prev = first
    for seed in range(3):
        nudge(masters, seed, lr=5e-7)
        view = cast.snapshot_native(masters, cfg, pool, prev)
        assert view is not None and view.step is not None and view.step.base() is prev
        expected = cast_view(masters, "bf16")
        assert list(view) == list(expected) and view.metadata == expected.metadata
        for name, t in view.items():
            assert t.kind == expected[name].kind and t.shape == expected[name].shape
            assert np.array_equal(t.data, expected[name].data), name
            assert not any(np.shares_memory(t.data, m) for m in masters.values())
        ref = diff(prev, view)
        assert cast.has_step(view, prev) and not cast.has_step(view, expected)
        step = cast.step_patch(prev, view, inspect(encode_views(prev, view)), {})
        assert view.step is None  # taken once
        assert set(step.tensors) == set(ref.tensors) and step.target == ref.target
        for name, tp in ref.tensors.items():
            got = step.tensors[name]
            assert (got.base_digest, got.target_digest) == (tp.base_digest, tp.target_digest)
            for a, b in zip(got.changes(), tp.changes(), strict=True):
                assert np.array_equal(a, b), name
        prev = view


def test_snapshot_native_leaves_what_it_cannot_cast_to_formats() -> None:
    pool = WordPool()
    m = random_masters(2, n=1)
    assert cast.snapshot_native(m, PublisherConfig(format="fp8-e4m3"), pool) is None
    bf = dict(m, extra=np.ones(4, np.float16))
    assert cast.snapshot_native(bf, PublisherConfig(format="bf16"), pool) is None
    assert cast.snapshot_native({}, PublisherConfig(format="bf16"), pool) is None


def test_a_changed_shape_or_a_dense_step_leaves_the_compare_to_the_encoder() -> None:
    cfg = PublisherConfig(format="bf16")
    pool = WordPool()
    m = random_masters(3, n=2)
    prev = cast.snapshot_native(m, cfg, pool)
    m2 = dict(m, **{"model.norm.weight": np.ones(64, np.float32)})
    assert cast.snapshot_native(m2, cfg, pool, prev).step is None  # type: ignore[union-attr]
    dense = {k: v * 3 for k, v in m.items()}  # every word changes: too many to list
    assert cast.snapshot_native(dense, cfg, pool, prev).step is None  # type: ignore[union-attr]


def test_step_patch_refuses_lists_the_encoder_contradicts() -> None:
    cfg = PublisherConfig(format="bf16")
    pool = WordPool()
    m = random_masters(4, n=2)
    prev = cast.snapshot_native(m, cfg, pool)
    nudge(m, 0, lr=5e-7)
    view = cast.snapshot_native(m, cfg, pool, prev)
    assert view is not None and view.step is not None
    header = inspect(encode_views(prev, view))
    name = next(iter(view.step.tensors))
    pos, old, new = view.step.tensors[name]
    view.step.tensors[name] = (pos[1:], old[1:], new[1:])
    with pytest.raises(BoardError, match="other changes"):
        cast.step_patch(prev, view, header, {})
    other = cast.snapshot_native(m, cfg, WordPool(), prev)
    assert other is not None
    other.step = cast.StepChanges(weakref.ref(view), other.step.tensors)  # type: ignore[union-attr]
    assert not cast.has_step(other, prev)


def _publish_all(
    name: str, native_snapshot: bool, monkeypatch: pytest.MonkeyPatch, *, as_torch: bool = False
) -> dict:
    """Publishes 11 versions (a skip patch at 8), returns every object and the expected views.
    ``as_torch``: the publisher is handed what a torch trainer hands it, the model's
    parameters (``torch.nn.Parameter``, requires_grad, sharing the masters' memory)."""
    if not native_snapshot:
        monkeypatch.setattr(cast, "snapshot_native", lambda *a, **k: None)
    masters = _masters(5)
    handed: dict = masters
    if as_torch:
        import torch

        handed = {k: torch.nn.Parameter(torch.from_numpy(m)) for k, m in masters.items()}
    expected = {}
    used = []
    orig = cast.step_patch
    monkeypatch.setattr(
        "rollpatch.publisher.pipeline.step_patch",
        lambda *a, **k: used.append(1) or orig(*a, **k),
    )
    with Publisher(f"memory://{name}", RUN, PublisherConfig(format="bf16")) as pub:
        for v in range(11):
            pub.publish(handed, v)
            expected[v] = copy_masters(masters)
            pub.flush()
            nudge(masters, v, lr=5e-7)
    monkeypatch.undo()
    board = Board(f"memory://{name}")
    objects = {}
    for v in range(11):
        man = board.manifest(RUN, v)
        for p in man.patches:
            objects[(v, p.base)] = board.store.get(p.ref.key)
    return {"objects": objects, "expected": expected, "used": len(used)}


def test_publisher_with_the_cast_step_writes_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = f"nc-{uuid.uuid4().hex[:10]}", f"nc-{uuid.uuid4().hex[:10]}"
    try:
        fused = _publish_all(a, True, monkeypatch)
        plain = _publish_all(b, False, monkeypatch)
        assert fused["used"] == 10 and plain["used"] == 0
        assert (8, 0) in fused["objects"]  # the skip patch, composed from the cast's steps
        assert fused["objects"].keys() == plain["objects"].keys()
        for key, blob in fused["objects"].items():
            assert blob == plain["objects"][key], key
        check_all(Board(f"memory://{a}"), fused["expected"])
    finally:
        MemoryStore.reset(a)
        MemoryStore.reset(b)


def test_a_torch_models_parameters_take_the_native_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch trainer's CPU float32 parameters go through the same native cast + compare as
    numpy masters (``to_numpy`` is a view of their memory): every step is taken from the
    cast (as ``bench/peers.py --trainer-cast torch`` measures), and the objects are the same
    bytes as from numpy masters."""
    pytest.importorskip("torch")
    a, b = f"nc-{uuid.uuid4().hex[:10]}", f"nc-{uuid.uuid4().hex[:10]}"
    try:
        from_torch = _publish_all(a, True, monkeypatch, as_torch=True)
        from_numpy = _publish_all(b, True, monkeypatch)
        assert from_torch["used"] == 10
        assert from_torch["objects"].keys() == from_numpy["objects"].keys()
        for key, blob in from_torch["objects"].items():
            assert blob == from_numpy["objects"][key], key
        check_all(Board(f"memory://{a}"), from_torch["expected"])
    finally:
        MemoryStore.reset(a)
        MemoryStore.reset(b)


def test_after_a_dropped_version_the_encoder_finds_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot compared with a version the queue then dropped is not the step from the
    pipeline's base: the encoder finds that step (and the skip patches stay right)."""
    name = f"nc-{uuid.uuid4().hex[:10]}"
    used: list[bool] = []
    orig = cast.has_step
    monkeypatch.setattr(
        "rollpatch.publisher.pipeline.has_step", lambda *a: used.append(orig(*a)) or used[-1]
    )
    masters = random_masters(6, n=3)
    expected = {}
    board = Board(SlowStore(name, delay=0.1))
    try:
        with Publisher(board, RUN, PublisherConfig(format="bf16")) as pub:
            for v in range(10):
                pub.publish(masters, v)  # no flush after v0: the queue drops some versions
                if v == 0:  # v0 built, so the versions kept after a drop have a base (without
                    pub.flush()  # this, a slow start could drop v0..v8 and build v9 whole)
                expected[v] = copy_masters(masters)
                nudge(masters, v, lr=5e-7)
            pub.flush()
            dropped = pub.stats.dropped
        assert dropped and False in used  # a dropped base was seen and left to the encoder
        kept = {v: m for v, m in expected.items() if v not in dropped}
        check_all(Board(f"memory://{name}"), kept)
    finally:
        MemoryStore.reset(name)


def test_a_core_built_before_the_cast_leaves_it_to_torch_and_formats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An installed core without ``cast_bf16`` (not rebuilt yet): the old paths, same bits."""
    pytest.importorskip("torch")
    old_core = type("OldCore", (), {})()
    monkeypatch.setattr(native, "core", old_core)
    x = _bits(4, 3000).view(np.float32)
    assert np.array_equal(cast.host_words(x), f32_to_bf16_bits(x))
    assert (
        cast.snapshot_native(random_masters(7, n=1), PublisherConfig(format="bf16"), WordPool())
        is None
    )
