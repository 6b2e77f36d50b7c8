"""Streamed keyframes: written and read tensor by tensor, bounded memory, every backend.

Memory is measured with tracemalloc, which sees numpy's buffers and Python's bytes (the
allocations that would hold a second copy of the view).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.errors import ConfigError, ManifestError, ViewError
from rollpatch.formats import cast_view
from rollpatch.io import read_view_ranges, view_chunks, view_from_bytes, view_to_bytes
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct
from rollpatch.store import FileStore, Store
from rollpatch.types import ObjectRef
from rollpatch.view import View
from tests.conftest_s3 import MiB, make_s3_store, pair, relay, store

_FIXTURES = (pair, relay, store)  # used by name (s3_server: tests/conftest.py)


def masters(n_params: int, seed: int = 0, *, tensors: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    per = n_params // tensors
    out = {
        f"layers.{i}.w": rng.standard_normal((per // 64, 64)).astype(np.float32) * 0.02
        for i in range(tensors)
    }
    out["norm"] = np.ones(64, np.float32)
    out["empty"] = np.zeros((0, 4), np.float32)
    return out


def view_of(fmt: str = "bf16", n_params: int = 1 << 16, **kw: Any) -> View:
    return cast_view(masters(n_params, **kw), fmt)


def peak_during(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(result, peak bytes allocated above the start) of ``fn()``."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "fp8-e4m3-block128"])
@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 30])
def test_chunks_and_ranges_round_trip(fmt: str, chunk: int) -> None:
    view = view_of(fmt, 1 << 12 if chunk < 16 else 1 << 16)
    size, pieces = view_chunks(view)
    blob = b"".join(bytes(p) for p in pieces())
    assert blob == view_to_bytes(view) and size == len(blob)  # the same serialization
    h = blake3.blake3()
    got = read_view_ranges(lambda a, b: blob[a:b], size, on_bytes=h.update, chunk_bytes=chunk)
    assert h.hexdigest() == blake3.blake3(blob).hexdigest()  # every byte, in order
    assert got.digest() == view.digest() and got.metadata == view.metadata
    assert {n: (t.kind.name, t.shape) for n, t in got.items()} == {
        n: (t.kind.name, t.shape) for n, t in view.items()
    }


def test_gaps_between_tensors_are_refused_and_every_byte_is_hashed() -> None:
    """The safetensors format forbids holes (bytes no tensor covers: an audit, session 41,
    found them accepted): refused between tensors and after the last; a file without them
    is read whole, every byte passed to the hash."""
    import json

    a, b = np.arange(6, dtype=np.uint16), np.arange(4, dtype=np.uint16)

    def blob(b_at: int, gap: bytes, tail: bytes) -> bytes:
        header = {
            "a": {"dtype": "BF16", "shape": [6], "data_offsets": [0, 12]},
            "b": {"dtype": "BF16", "shape": [4], "data_offsets": [b_at, b_at + 8]},
        }
        raw = json.dumps(header).encode()
        return len(raw).to_bytes(8, "little") + raw + a.tobytes() + gap + b.tobytes() + tail

    for bad in (blob(20, b"\xee" * 8, b""), blob(12, b"", b"\xff" * 3)):
        with pytest.raises(ViewError, match="hole"):
            read_view_ranges(lambda s, e, x=bad: x[s:e], len(bad), chunk_bytes=5)
        with pytest.raises(ViewError, match="hole"):
            view_from_bytes(bad)
    good = blob(12, b"", b"")
    seen = bytearray()
    v = read_view_ranges(lambda s, e: good[s:e], len(good), on_bytes=seen.extend, chunk_bytes=5)
    assert bytes(seen) == good
    assert np.array_equal(v["a"].data, a) and np.array_equal(v["b"].data, b)


def test_board_streams_a_view_through_every_backend(pair: tuple[Store, Store]) -> None:
    writer, reader = pair
    view = view_of("bf16", 3 * MiB)  # > 5 MiB: multipart on S3
    ref = Board(writer).put_view_object("r1", view)
    blob = view_to_bytes(view)
    assert ref.size == len(blob) and ref.b3 == blake3.blake3(blob).hexdigest()
    assert ref.key == f"runs/r1/objects/{ref.b3}.safetensors"
    assert writer.get(ref.key) == blob
    assert Board(writer).put_view_object("r1", view) == ref  # idempotent
    got = Board(reader).fetch_view(ref, chunk_bytes=MiB)
    assert got.digest() == view.digest()


def test_put_stream_refuses_a_wrong_size_and_stores_nothing(store: Store) -> None:
    with pytest.raises(ConfigError, match="fewer bytes"):
        store.put_stream("k/short", [b"abc"], size=4)
    with pytest.raises(ConfigError, match="more bytes"):
        store.put_stream("k/long", [b"abc", b"de"], size=4)
    assert store.head("k/short") is None and store.head("k/long") is None
    store.put_stream("k/ok", [b"ab", memoryview(b"cd")], size=4)
    assert store.get("k/ok") == b"abcd"


def test_s3_streamed_multipart_is_put_if_absent(request: pytest.FixtureRequest) -> None:
    s3 = make_s3_store(request)
    data = np.random.default_rng(1).integers(0, 256, 12 * MiB + 5, dtype=np.uint8).tobytes()
    pieces = [memoryview(data)[i : i + 3 * MiB + 1] for i in range(0, len(data), 3 * MiB + 1)]
    s3.put_stream("big", pieces, size=len(data))
    assert s3.get("big") == data
    from rollpatch.errors import AlreadyExistsError

    with pytest.raises(AlreadyExistsError):
        s3.put_stream("big", [data[::-1]], size=len(data))
    assert s3.get("big") == data


def _corrupt(tmp_path: Path, edit: Callable[[bytearray], bytes]) -> tuple[Board, ObjectRef]:
    store = FileStore(tmp_path / "b")
    board = Board(store)
    ref = board.put_view_object("r1", view_of())
    path = tmp_path / "b" / ref.key
    path.write_bytes(edit(bytearray(path.read_bytes())))
    return board, ref


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda b: bytes(b[:-1]) + bytes([b[-1] ^ 1]), id="flipped-bit"),
        pytest.param(lambda b: bytes(b[:-10]), id="truncated"),
        pytest.param(lambda b: bytes(b[:8]) + b"[" + bytes(b[9:]), id="bad-header"),
        pytest.param(lambda b: (2**40).to_bytes(8, "little") + bytes(b[8:]), id="huge-header"),
    ],
)
def test_a_corrupt_keyframe_is_refused(tmp_path: Path, edit: Any) -> None:
    board, ref = _corrupt(tmp_path, edit)
    with pytest.raises(ManifestError):
        board.fetch_view(ref)


def test_reading_holds_the_view_plus_one_chunk(tmp_path: Path) -> None:
    """Streamed: peak ≈ the view + one window. Whole-object fetch: ≥ 2 × the view."""
    view = view_of("bf16", 4 * MiB, tensors=16)  # 8 MiB view, 16 tensors of 512 KiB
    board = Board(FileStore(tmp_path / "b"))
    ref = board.put_view_object("r1", view)
    chunk = 256 * 1024
    got, peak = peak_during(lambda: board.fetch_view(ref, chunk_bytes=chunk))
    assert got.digest() == view.digest()
    assert peak <= view.nbytes + 2 * chunk + 256 * 1024, (peak, view.nbytes)
    _, whole = peak_during(lambda: view_from_bytes(board.fetch(ref)))
    assert whole >= 2 * view.nbytes


def test_writing_never_serializes_the_view(tmp_path: Path) -> None:
    view = view_of("bf16", 4 * MiB, tensors=16)
    board = Board(FileStore(tmp_path / "b"))
    ref, peak = peak_during(lambda: board.put_view_object("r1", view))
    assert (tmp_path / "b" / ref.key).stat().st_size == ref.size
    assert peak < view.nbytes // 8, (peak, view.nbytes)
    _, whole = peak_during(lambda: board.put_object("r2", view_to_bytes(view), "safetensors"))
    assert whole >= view.nbytes


def test_published_keyframes_are_streamed_and_boot(tmp_path: Path) -> None:
    """End to end: the publisher's keyframe bytes are the safetensors of the view, and a
    reconstruct from the board (the follower's keyframe path) streams it back, verified."""
    uri = f"file://{tmp_path / 'board'}"
    cfg = PublisherConfig(format="bf16", keyframe_every=2, skip_strides=())
    with Publisher(uri, "r1", cfg, asynchronous=False) as pub:
        for seed in range(3):
            pub.publish(masters(1 << 14, seed=seed))
    board = Board(uri)
    m = board.manifest("r1", 2)
    assert m.is_keyframe
    want = cast_view(masters(1 << 14, seed=2), "bf16")
    assert view_from_bytes(board.fetch(m.keyframes[0].ref)).digest() == want.digest()
    assert reconstruct(board, "r1", 2).digest() == want.digest() == m.target


def test_shard_resume_needs_the_same_layout(tmp_path: Path) -> None:
    """reconstruct_shard rebuilds one rank's part only when the board has that shard; else
    None (the publisher then rebuilds the whole view). shard_matches guards the names."""
    from rollpatch.publisher.keyframe import reconstruct_shard, shard_matches

    uri = f"file://{tmp_path / 'board'}"
    cfg = PublisherConfig(format="nvfp4", keyframe_every=2, skip_strides=())
    with Publisher(uri, "r1", cfg, asynchronous=False) as pub:
        for seed in range(4):
            pub.publish(masters(1 << 14, seed=seed))
    board = Board(uri)
    whole = reconstruct_shard(board, "r1", 3, 0, 1)  # one shard: the whole view
    assert whole is not None and whole.digest() == board.manifest("r1", 3).target
    assert reconstruct_shard(board, "r1", 3, 0, 2) is None  # published by one rank, not two
    names = set(masters(1 << 14))
    assert shard_matches(whole, names, "nvfp4")
    assert not shard_matches(whole, names - {"norm"}, "nvfp4")
    assert not shard_matches(whole, names | {"extra"}, "nvfp4")
