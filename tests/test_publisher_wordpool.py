"""The host snapshot's recycled word buffers (``publisher/wordpool.py``): a buffer is handed out
again only when nothing references it (no view, tensor or torch tensor of it is alive), and
publishing through recycled buffers gives the same versions, bit for bit."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rollpatch.board import Board
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig, snapshot
from rollpatch.publisher.cast import host_words
from rollpatch.publisher.wordpool import WordPool
from rollpatch.store import MemoryStore
from tests.pubfix import RUN, check_all, copy_masters, nudge, random_masters


def test_free_buffer_is_reused_and_held_one_is_not() -> None:
    pool = WordPool()
    a = pool.take("w", 100)
    b = pool.take("w", 100)
    assert not np.shares_memory(a, b)  # a is held here
    a_addr = a.ctypes.data
    del a
    c = pool.take("w", 100)
    assert c.ctypes.data == a_addr and pool.reused == 1  # free again: the same memory
    assert pool.take("other", 100).ctypes.data != a_addr  # per name


@pytest.mark.parametrize(
    "holder",
    [
        lambda a: a.reshape(10, 10),
        lambda a: a.view(np.int16)[3:7],
        lambda a: torch.from_numpy(a.view(np.int16)),
        lambda a: memoryview(a),
    ],
    ids=["reshape", "dtype-slice", "torch", "memoryview"],
)
def test_a_buffer_that_any_view_still_uses_is_not_handed_out(holder: object) -> None:
    pool = WordPool()
    a = pool.take("w", 100)
    addr = a.ctypes.data
    held = holder(a)  # type: ignore[operator]
    del a
    again = pool.take("w", 100)
    assert again.ctypes.data != addr  # the held one stays untouched
    del held, again
    assert pool.take("w", 100).ctypes.data == addr


def test_size_change_and_cap() -> None:
    pool = WordPool(per_name=2)
    a, b, c = pool.take("w", 8), pool.take("w", 8), pool.take("w", 8)  # c is not kept
    kept = {a.ctypes.data, b.ctypes.data}
    del a, b, c
    assert pool.take("w", 8).ctypes.data in kept
    bigger = pool.take("w", 16)  # a free 8-element buffer is dropped for it
    assert bigger.size == 16 and bigger.dtype == np.uint16
    assert pool.allocated == 4


def test_host_words_into_out_is_the_cast() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(70_001).astype(np.float32)
    x[[5, 9]] = [np.nan, np.inf]
    out = np.full(x.size, 0x1234, np.uint16)
    got = host_words(x, out)
    assert got is out and np.array_equal(out, host_words(x))
    for bad in (
        np.empty(x.size - 1, np.uint16),
        np.empty(x.size, np.int32),
        x.view(np.uint16)[::2],
    ):
        with pytest.raises(ValueError, match="out must be"):
            host_words(x, bad)


def test_snapshots_through_the_pool_are_the_cast_and_never_overwrite_a_held_view() -> None:
    pool = WordPool()
    cfg = PublisherConfig(format="bf16")
    masters = random_masters(5, n=2)
    held = snapshot.snapshot_served(masters, cfg, pool)
    first = {k: t.data.copy() for k, t in held.items()}
    for seed in range(3):
        nudge(masters, seed)
        view = snapshot.snapshot_served(masters, cfg, pool)
        expected = cast_view(masters, "bf16")
        for name, t in view.items():
            assert np.array_equal(t.data, expected[name].data), name
            assert not np.shares_memory(t.data, held[name].data), name
        for name, t in held.items():  # the held view kept its words
            assert np.array_equal(t.data, first[name]), name
        del view
    assert pool.reused > 0


def test_publisher_reuses_snapshot_buffers_bit_exact() -> None:
    name = f"pool-{uuid.uuid4().hex[:12]}"
    masters = random_masters(11, n=3)
    expected = {}
    with Publisher(f"memory://{name}", RUN, PublisherConfig(skip_strides=(2,))) as pub:
        for v in range(6):
            pub.publish(masters, v)
            expected[v] = copy_masters(masters)
            pub.flush()
            nudge(masters, v)
        assert pub._words.reused > 0  # the pages of earlier snapshots were written again
    check_all(Board(f"memory://{name}"), expected)
    MemoryStore.reset(name)
