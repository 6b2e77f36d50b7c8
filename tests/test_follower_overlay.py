"""Staging over an overlay: a catch-up copies only the tensors its patches touch and holds
patches, not a model copy. The published board: tests/followfix.py.
"""

from __future__ import annotations

import threading
import weakref
from typing import ClassVar

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.errors import BaseMismatchError
from rollpatch.follower import Follower
from rollpatch.patch import compose, decode, diff, encode
from rollpatch.patch.overlay import Overlay
from rollpatch.view import Tensor, View
from tests.followfix import FAST, LAST, RUN, Published, assert_holds, board, engine_at, published

_FIXTURES = (board, published)  # used by name


def test_overlay_copies_only_touched_tensors(published: Published) -> None:
    views = published.views
    v = next(
        i for i in range(LAST - 1) if len(diff(views[i], views[i + 1]).tensors) < len(views[i])
    )
    v0, v1, v2 = views[v], views[v + 1], views[v + 2]
    p1 = diff(v0, v1)
    ov = Overlay(v0, p1)
    untouched = next(n for n in v0 if n not in p1.tensors)
    assert ov[untouched] is v0[untouched]
    assert ov.copied_tensors == 0
    touched = next(iter(p1.tensors))
    before = v0[touched].data.copy()
    got = ov[touched]
    assert got is not v0[touched] and np.array_equal(got.data, v1[touched].data)
    assert (ov.copied_tensors, ov.copied_bytes) == (1, v0[touched].nbytes)
    assert np.array_equal(v0[touched].data, before)  # the base is never written
    # decoding step 2 against the overlay equals decoding it against the materialised view
    blob = encode(diff(v1, v2), v1)
    ov = Overlay(v0, p1)
    step = decode(blob, ov, check_base=False)
    assert step.equals(decode(blob, v1))
    both = set(p1.tensors) & set(step.tensors)
    assert ov.copied_tensors == len(both)
    assert ov.copied_bytes == sum(v0[n].nbytes for n in both) < v0.nbytes
    assert compose(p1, step).equals(diff(v0, v2))


def test_overlay_drop_full_and_wrong_base() -> None:
    a = View(
        {
            "x": Tensor.from_array(np.arange(8, dtype=np.uint16), "u16"),
            "y": Tensor.from_array(np.arange(4, dtype=np.uint16), "u16"),
        }
    )
    b = View(
        {
            "x": Tensor.from_array(np.arange(8, dtype=np.uint16) + 1, "u16"),
            "z": Tensor.from_array(np.arange(3, dtype=np.uint32), "u32"),
        }
    )
    ov = Overlay(a, diff(a, b))
    assert "y" not in ov and "z" in ov and ov["z"].shape == (3,)
    with pytest.raises(KeyError):
        ov["y"]
    wrong = a.copy()
    wrong["x"].data[0] = 99
    with pytest.raises(BaseMismatchError):
        Overlay(wrong, diff(a, b))["x"]


class TrackingOverlay(Overlay):
    """Records every tensor an overlay lends, whether it was a copy, and peak live copies."""

    live = 0
    peak = 0
    lent: ClassVar[list[tuple[str, bool, bool]]] = []  # (name, copied, touched by the patch)
    lock = threading.Lock()

    def __getitem__(self, name: str) -> Tensor:
        t = super().__getitem__(name)
        copied = name in self.base and t is not self.base[name]
        cls = TrackingOverlay
        with cls.lock:
            cls.lent.append((name, copied, name in self.patch.tensors))
            if copied:
                cls.live += 1
                cls.peak = max(cls.peak, cls.live)
        if copied:
            weakref.finalize(t, cls._release)
        return t

    @staticmethod
    def _release() -> None:
        with TrackingOverlay.lock:
            TrackingOverlay.live -= 1


def test_catch_up_holds_patches_not_a_model_copy(
    board: Board, published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpatch.follower import stage

    monkeypatch.setattr(stage, "Overlay", TrackingOverlay)
    TrackingOverlay.lent = []
    engine = engine_at(published, 4)
    f = Follower(board, RUN, engine, FAST)
    assert f.sync(19) == 19
    assert_holds(engine, published.views[19])
    lent = TrackingOverlay.lent
    assert any(copied for _, copied, _ in lent)
    assert all(touched for _, copied, touched in lent if copied)  # untouched: never copied
    assert TrackingOverlay.live == 0
    # the decoder's pool (4 threads) holds at most one lent tensor each
    assert TrackingOverlay.peak <= 4 < len(published.views[4])
