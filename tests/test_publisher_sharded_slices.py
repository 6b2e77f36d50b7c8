"""Slices: ranks publish element ranges of one tensor, never a gathered copy (issue 14).

Ranks run as threads of this process, joined by ``ThreadGroup`` (the same
JSON round trip as gloo's; the real gloo + DTensor run is tests/test_publisher_sharded_dtensor.py).
Each version's manifest must name the same target as an unsharded publish of the whole state
dict, followers must reach every version bit for bit through step patches, skip patches and
sliced keyframes, and bad slicings must fail with a clear error before anything is pointed at.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.engines.view_engine import ViewEngine
from rollpatch.errors import BoardError, ConfigError, ManifestError
from rollpatch.follower import Follower
from rollpatch.formats import QuantPolicy, cast_view
from rollpatch.manifest import Manifest, open_manifest
from rollpatch.publisher import Publisher, PublisherConfig, TensorSlice, reconstruct
from rollpatch.publisher.sharded import Exchange
from tests.pubfix import run_ranks

RUN = "sliced"
MANIFESTS = Path(__file__).parent / "manifests"
SHAPES = {"w.a": (64, 48), "w.b": (999,), "w.c": (30, 20)}
#: rank → (tensor, first row, end row); w.b's cuts straddle 8-byte words (bf16: 4 per word)
CUTS = {
    0: [("w.a", 0, 25), ("w.b", 0, 333)],
    1: [("w.a", 25, 40), ("w.b", 333, 501), ("w.c", 0, 30)],
    2: [("w.a", 40, 64), ("w.b", 501, 999)],
}


def masters(version: int) -> dict[str, np.ndarray]:
    base = np.random.default_rng(0)
    step = np.random.default_rng(100 + version)
    out = {}
    for name, shape in SHAPES.items():
        w = base.standard_normal(shape).astype(np.float32)
        out[name] = w + (version * 1e-3 * step.standard_normal(shape)).astype(np.float32)
    return out


def local(version: int, rank: int, cuts: dict[int, list[tuple[str, int, int]]] = CUTS) -> dict:
    full = masters(version)
    out: dict[str, Any] = {}
    for name, a, b in cuts[rank]:
        shape = SHAPES[name]
        row = int(np.prod(shape[1:], dtype=np.int64))
        part = full[name][a:b].copy()
        out[name] = TensorSlice(part, a * row, shape) if part.shape != shape else part
    return out


def publish_versions(
    board: Board, versions: range, cfg: PublisherConfig, cuts: dict = CUTS
) -> list[Any]:
    def body(rank: int, x: Exchange) -> Any:
        with Publisher(board, RUN, cfg, group=x, asynchronous=False) as pub:
            for v in versions:
                pub.publish(local(v, rank, cuts), v)
            return pub.resume_scope

    return run_ranks(body, len(cuts))


CFG = PublisherConfig(format="bf16", keyframe_every=4, skip_strides=(2,))


def test_sliced_versions_match_an_unsharded_publish(tmp_path: Path) -> None:
    board = Board(tmp_path.as_uri())
    assert publish_versions(board, range(6), CFG) == [None] * 3
    for v in range(6):
        m = board.manifest(RUN, v)
        want = cast_view(masters(v), "bf16")
        assert m.target == want.digest(), v  # the whole view's digest, from slices only
        assert m.shards == 3 and [t.name for t in m.sliced] == ["w.a", "w.b"]
        assert json.loads(m.to_bytes())["schema"] == "rollpatch.manifest/2"
        assert {t.name: t.digest for t in m.sliced} == {k: want[k].digest() for k in ("w.a", "w.b")}
        assert reconstruct(board, RUN, v).digest() == want.digest()
    a = board.manifest(RUN, 5).sliced[0]
    assert [(e.shard, e.offset, e.shape) for e in a.slices] == [
        (0, 0, (25, 48)),
        (1, 1200, (15, 48)),
        (2, 1920, (24, 48)),
    ]
    assert board.keyframes(RUN) == [0, 4]
    assert {p.base for p in board.manifest(RUN, 4).patches} == {2, 3}  # a skip patch too


def test_followers_apply_slices_in_place(tmp_path: Path) -> None:
    board = Board(tmp_path.as_uri())
    publish_versions(board, range(6), CFG)
    step = Follower(board, RUN, ViewEngine())  # keyframe 0, then one step at a time
    step.sync(0)
    held = step.engine.words()
    for v in range(1, 6):
        assert step.sync(v) == v
        assert step.engine.words() is held  # patched in place, never re-assembled
        assert held.digest() == cast_view(masters(v), "bf16").digest()
    late = Follower(board, RUN, ViewEngine())  # 1 → 5: skip patches 2→4, then steps
    late.sync(1)
    assert late.sync(5) == 5
    assert late.engine.words().digest() == board.manifest(RUN, 5).target
    boot = Follower(board, RUN, ViewEngine())  # the sliced keyframe at 4, then 5
    assert boot.sync(5) == 5
    assert boot.engine.words().digest() == board.manifest(RUN, 5).target


def test_resume_rebuilds_only_each_ranks_slices(tmp_path: Path) -> None:
    board = Board(tmp_path.as_uri())
    publish_versions(board, range(3), CFG)
    assert publish_versions(board, range(3, 6), CFG) == ["shard"] * 3
    for v in range(6):
        assert board.manifest(RUN, v).target == cast_view(masters(v), "bf16").digest()


def test_signed_sliced_versions(tmp_path: Path) -> None:
    """The signature covers the slices: a follower with the trust root follows; a manifest
    whose slice layout is edited no longer verifies."""
    from rollpatch.errors import TrustError
    from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root

    key = SigningKey.generate()
    cfg = PublisherConfig(
        format="bf16", keyframe_every=4, skip_strides=(2,), signer=Signer(keys=(key,))
    )
    board = Board(tmp_path.as_uri())
    publish_versions(board, range(3), cfg)
    trust = Trust(sign_root(Root.new([key.public]), [key]))
    f = Follower(Board(board.store, trust=trust), RUN, ViewEngine())
    assert f.sync(2) == 2 and f.engine.words().digest() == cast_view(masters(2), "bf16").digest()
    doc = json.loads(board.store.get(f"runs/{RUN}/versions/{2:012d}.json"))
    payload = json.loads(base64.b64decode(doc["payload"]))
    payload["sliced"][0]["digest"] = "0" * 64  # still a well-formed manifest
    doc["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    with pytest.raises(TrustError):
        open_manifest(json.dumps(doc).encode(), RUN, 2, trust)


def _expect_failure(results: list[Any], error: type[Exception], match: str) -> None:
    assert all(isinstance(r, Exception) for r in results), results
    assert any(isinstance(r, error) and match in str(r) for r in results), results


def test_overlapping_or_missing_slices_are_refused(tmp_path: Path) -> None:
    board = Board(tmp_path.as_uri())
    gap = {0: [("w.a", 0, 25)], 1: [("w.a", 26, 64)]}
    _expect_failure(publish_versions(board, range(1), CFG, gap), BoardError, "leave a gap")
    over = {0: [("w.a", 0, 30)], 1: [("w.a", 25, 64)]}
    _expect_failure(publish_versions(board, range(1), CFG, over), BoardError, "overlap")
    short = {0: [("w.a", 0, 25)], 1: [("w.a", 25, 63)]}
    _expect_failure(publish_versions(board, range(1), CFG, short), BoardError, "cover")
    assert board.versions(RUN) == [] and board.latest(RUN) is None


def test_changed_slicing_is_refused_and_the_board_kept(tmp_path: Path) -> None:
    board = Board(tmp_path.as_uri())
    publish_versions(board, range(2), CFG)
    moved = {
        0: [("w.a", 0, 30), ("w.b", 0, 333)],
        1: [("w.a", 30, 40), ("w.b", 333, 501), ("w.c", 0, 30)],
    }
    moved[2] = CUTS[2]
    _expect_failure(publish_versions(board, range(2, 3), CFG, moved), BoardError, "slicing")
    assert board.versions(RUN) == [0, 1] and board.latest(RUN).version == 1  # type: ignore[union-attr]


def test_quantised_slices_are_refused() -> None:
    """A format that quantises a sliced tensor with scales cannot slice it; a tensor that
    format leaves in BF16 (here w.b, w.c) could be."""
    policy = QuantPolicy(include=("w.a",))
    cfg = PublisherConfig(format="fp8-e4m3", policy=policy, keyframe_every=4, skip_strides=())
    board = Board("memory://sliced-fp8")
    results = publish_versions(board, range(1), cfg)
    _expect_failure(results, ConfigError, "scales")
    assert board.versions(RUN) == []


def test_sliced_digest_at_every_cut() -> None:
    """Whole-tensor digests from slice parts at every byte alignment (bf16 and fp16)."""
    from rollpatch.publisher.sharded_slices import SliceSpec, combine, slice_part

    rng = np.random.default_rng(5)
    for fmt in ("bf16", "fp16"):
        w = rng.standard_normal(37).astype(np.float32)
        whole = cast_view({"w": w}, fmt)["w"]
        for cut in range(1, 37):
            parts = [
                (0, slice_part(cast_view({"w": w[:cut]}, fmt)["w"], SliceSpec(0, (37,), (cut,)))),
                (
                    1,
                    slice_part(
                        cast_view({"w": w[cut:]}, fmt)["w"], SliceSpec(cut, (37,), (37 - cut,))
                    ),
                ),
            ]
            assert combine("w", parts).digest == whole.digest(), (fmt, cut)


# -- the manifest: schema 2, golden files, strict parsing --------------------------------------


def test_golden_manifests_round_trip() -> None:
    for name in ("v1_sharded.json", "v2_sliced.json"):
        raw = (MANIFESTS / name).read_bytes().strip()
        m = Manifest.from_bytes(raw)
        assert m.to_bytes() == raw, name
    v2 = Manifest.from_bytes((MANIFESTS / "v2_sliced.json").read_bytes())
    assert [(e.shard, e.offset) for e in v2.sliced[0].slices] == [(0, 0), (1, 32)]
    assert v2.slices_of(1)["w.a"].shape == (6, 8)
    assert not Manifest.from_bytes((MANIFESTS / "v1_sharded.json").read_bytes()).sliced


@pytest.mark.parametrize(
    "hack",
    [
        lambda d: d.update(schema="rollpatch.manifest/1"),  # slices need schema 2
        lambda d: d["sliced"][0]["slices"][1].update(offset=31),  # overlap
        lambda d: d["sliced"][0]["slices"][1].update(shape=[5, 8]),  # does not cover
        lambda d: d["sliced"][0]["slices"][1].update(shard=0),  # one slice per shard
        lambda d: d["sliced"][0]["slices"][1].update(shard=7),  # no such shard
        lambda d: d["sliced"][0].update(digest="zz"),
        lambda d: d["sliced"].append(d["sliced"][0]),  # listed twice
        lambda d: d["sliced"][0].update(shape=[1] * 9),  # too many dims
        lambda d: d["sliced"][0].update(dtype="bf16; rm"),
    ],
)
def test_hostile_sliced_manifests_are_refused(hack: Callable[[dict], None]) -> None:
    d = json.loads((MANIFESTS / "v2_sliced.json").read_bytes())
    hack(d)
    with pytest.raises(ManifestError):
        Manifest.from_bytes(json.dumps(d).encode())


# -- followers decode shard objects as they arrive ---------------------------------------------


def test_shard_objects_decode_as_they_arrive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-step plan of several shard objects is decoded object by object while the fetch
    runs (``EarlyDecode``); staging joins those parts, which equal a decode after the fetch."""
    from rollpatch.follower import stage
    from rollpatch.replay import decode_step

    board = Board(tmp_path.as_uri())
    publish_versions(board, range(2), CFG)
    f = Follower(board, RUN, ViewEngine())
    f.sync(0)
    plan = board.plan(RUN, 0, 1)
    manifests = {n: board.manifest(RUN, n) for n in (0, 1)}
    early = stage.EarlyDecode.for_plan(f.engine, plan, manifests, 0)
    assert early is not None
    assert stage.EarlyDecode.for_plan(f.engine, board.plan(RUN, None, 1), manifests, None) is None
    blobs = {r.key: board.fetch(r) for r in plan.steps[0].objects}
    for r in plan.steps[0].objects:
        early.arrived(r, blobs[r.key])
    parts = early.results()
    early.close()
    assert set(parts) == set(blobs) and len(parts) == 3
    joined = decode_step(manifests[1], manifests[0], dict(blobs), f.engine.words(), parts)
    plain = decode_step(manifests[1], manifests[0], dict(blobs), f.engine.words())
    assert joined.target == plain.target == manifests[1].target
    for name, tp in plain.tensors.items():
        got = joined.tensors[name]
        assert (got.target_digest, got.base_digest) == (tp.target_digest, tp.base_digest)
        assert np.array_equal(got.changes().positions, tp.changes().positions)
        assert np.array_equal(got.changes().new, tp.changes().new)

    used: list[int] = []
    real = stage.decode_step

    def spy(m: Any, base: Any, blobs: Any, source: Any, decoded: Any = None) -> Any:
        used.append(len(decoded or {}))
        return real(m, base, blobs, source, decoded)

    monkeypatch.setattr(stage, "decode_step", spy)
    assert f.sync(1) == 1
    assert used == [3]  # every shard object came decoded from the fetch
    assert f.engine.words().digest() == manifests[1].target


def test_native_sum_at_a_global_offset_equals_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sum_at`` (native sum over words copied to their global position in a sparse mapping)
    equals the numpy reference of rp.sum128 at any word offset, across chunk boundaries."""
    from rollpatch import native
    from rollpatch.publisher import sharded_slices

    if native.core is None:
        pytest.skip("the native core is not built")
    monkeypatch.setattr(sharded_slices, "_CHUNK_WORDS", 1000)  # several chunks
    data = np.random.default_rng(3).integers(0, 256, 8 * 4321, dtype=np.uint8)
    for first in (0, 1, 999, 10**9):  # 10^9 words: 8 GB of untouched address space
        fast = sharded_slices.sum_at(data, first)
        monkeypatch.setattr(native, "core", None)
        ref = sharded_slices.sum_at(data, first)
        monkeypatch.undo()
        monkeypatch.setattr(sharded_slices, "_CHUNK_WORDS", 1000)
        assert fast == ref, first


def test_slices_that_name_different_global_shapes_are_refused_as_such(tmp_path: Path) -> None:
    """Audit J, L2 (session 42): slices of (10, 7) against (7, 10) were refused as a gap or
    an overlap at ``offset=35, expected_offset=35``, naming no shape."""
    board = Board(tmp_path.as_uri())

    def body(rank: int, x: Exchange) -> Any:
        shape = (10, 7) if rank == 0 else (7, 10)
        part = np.ones(35, dtype=np.float32)  # 35 elements each: no gap, no overlap
        with Publisher(board, RUN, CFG, group=x, asynchronous=False) as pub:
            pub.publish({"w.t": TensorSlice(part, 35 * rank, shape)}, 0)

    results = run_ranks(body)
    _expect_failure(results, BoardError, "different global shapes")
    assert any("(7, 10)" in str(r) and "(10, 7)" in str(r) for r in results), results
