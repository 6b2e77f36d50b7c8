"""The skip patch's base view rebuilt ahead (publisher/skipbase.py): when the worker settles the
version before a skip version, it rewinds the held view to the skip base, and the skip
version's build codes the skip patch from that view instead of composing and rewinding on
the way to LATEST. Whatever path a version takes, the board must hold the bytes a synchronous
publisher (which never rebuilds ahead) writes; a rebuilt base that does not fit the build is
not used; a base that does not rewind is an error raised, never a wrong patch."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.errors import RollpatchError
from rollpatch.formats import cast_view
from rollpatch.patch import apply, decode
from rollpatch.publisher import Publisher, PublisherConfig, core, pipeline
from rollpatch.store import MemoryStore
from tests.pubfix import RUN, check_all, copy_masters, nudge, random_masters

Step = tuple[int, dict[str, np.ndarray]]


def _wait(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cond(), "not within 60 s"


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for n in made:
        MemoryStore.reset(n)


def _board(names: list[str]) -> str:
    names.append(f"skipbase-{uuid.uuid4().hex[:10]}")
    return f"memory://{names[-1]}"


def _steps(versions: list[int], seed: int = 31) -> list[Step]:
    masters = random_masters(seed, n=3)
    out = []
    for v in versions:
        out.append((v, copy_masters(masters)))
        nudge(masters, v, lr=1e-4)
    return out


def _objects(uri: str) -> dict[tuple[int, int], bytes]:
    board = Board(uri)
    return {
        (v, p.base): board.store.get(p.ref.key)
        for v in board.versions(RUN)
        for p in board.manifest(RUN, v).patches
    }


def _publish(uri: str, steps: list[Step], cfg: PublisherConfig, *, asynchronous: bool) -> None:
    with Publisher(uri, RUN, cfg, asynchronous=asynchronous) as pub:
        for v, masters in steps:
            pub.publish(masters, v)
            pub.flush()
            if asynchronous:
                _wait(lambda: not pub._writer.pipe.unsettled)


def _same_as_sync(names: list[str], steps: list[Step], cfg: PublisherConfig) -> str:
    """Publish ``steps`` asynchronously (settled after each) and synchronously; the boards
    hold the same objects, and every version reconstructs. Returns the async board."""
    a, b = _board(names), _board(names)
    _publish(a, steps, cfg, asynchronous=True)
    _publish(b, steps, cfg, asynchronous=False)
    got, want = _objects(a), _objects(b)
    assert got.keys() == want.keys()
    for key, blob in got.items():
        assert blob == want[key], key
    check_all(Board(a), dict(steps))
    return a


def test_the_skip_patch_is_coded_from_the_base_rebuilt_ahead(
    names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "SETTLE_AFTER_S", 0.0)
    steps = _steps(list(range(10)))
    uri = _board(names)
    cfg = PublisherConfig(format="bf16", skip_strides=(4,))
    rewinds: list[int] = []
    real = pipeline.rewind

    def counted(*args: object, **kw: object) -> object:
        rewinds.append(int(kw["base"]))  # type: ignore[call-overload]
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "rewind", counted)  # the build's rewind, not the settle's
    with Publisher(uri, RUN, cfg) as pub:
        for v, masters in steps:
            pub.publish(masters, v)
            pub.flush()
            _wait(lambda: not pub._writer.pipe.unsettled)
            r = pub._writer.pipe._rewound
            if v in (3, 7):  # the next version is due for a skip patch from v - 3
                assert r is not None and (r.base, r.through) == (v - 3, v)
                assert r.view.digest() == Board(uri).manifest(RUN, v - 3).target
            else:
                assert r is None
    assert rewinds == []  # both skip patches (4 <- 0, 8 <- 4) came from the rebuilt bases
    blob = _objects(uri)[(8, 4)]
    base = cast_view(dict(steps)[4], "bf16")
    assert apply(base, decode(blob, base)).digest() == cast_view(dict(steps)[8], "bf16").digest()
    monkeypatch.setattr(pipeline, "rewind", real)
    _same_as_sync(names, steps, cfg)


def test_a_version_is_unsettled_until_its_rebuilt_base_is_in_place(
    names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unsettled`` covers the whole settle: the skip base's rebuild too (it used to clear
    before the rebuild ran, so a reader saw no rebuilt base during a slow one)."""
    monkeypatch.setattr(core, "SETTLE_AFTER_S", 0.0)
    real = pipeline.rebuild_ahead

    def slow(*args: object, **kw: object) -> object:
        time.sleep(0.3)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "rebuild_ahead", slow)
    steps = _steps(list(range(4)))
    with Publisher(_board(names), RUN, PublisherConfig(format="bf16", skip_strides=(4,))) as pub:
        for v, masters in steps:
            pub.publish(masters, v)
            pub.flush()
        _wait(lambda: not pub._writer.pipe.unsettled)
        r = pub._writer.pipe._rewound
        assert r is not None and (r.base, r.through) == (0, 3)


@pytest.mark.parametrize("after_s", [0.0, 3600.0], ids=["settled-after-latest", "in-next-build"])
def test_two_strides_due_at_once_write_the_sync_bytes(
    after_s: float, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 8 both strides are due: the longest (from 0) is rebuilt ahead, the other (from 4)
    composed and rewound in the build; settled in the next build, the same."""
    monkeypatch.setattr(core, "SETTLE_AFTER_S", after_s)
    steps = _steps(list(range(13)), seed=32)
    a, b = _board(names), _board(names)
    cfg = PublisherConfig(format="bf16", skip_strides=(4, 8))
    with Publisher(a, RUN, cfg) as pub:
        for v, masters in steps:
            pub.publish(masters, v)
            pub.flush()
            if after_s == 0.0:
                _wait(lambda: not pub._writer.pipe.unsettled)
    _publish(b, steps, cfg, asynchronous=False)
    got, want = _objects(a), _objects(b)
    assert {(4, 0), (8, 0), (8, 4), (12, 8)} <= set(got)
    assert got == want
    check_all(Board(a), dict(steps))


def test_a_rebuilt_base_that_does_not_fit_is_not_used(names: list[str]) -> None:
    """Version 4 never published (3 then 5): nothing is due, the rebuilt base is dropped at
    the next commit; a tensor added at a skip version: step patches only, as without it."""
    _same_as_sync(names, _steps([0, 1, 2, 3, 5, 6, 7, 8]), PublisherConfig(skip_strides=(4,)))
    steps = _steps(list(range(6)), seed=33)
    for _, masters in steps[4:]:
        masters["model.extra.weight"] = np.full(32, 0.5, np.float32)
    cfg = PublisherConfig(format="bf16", skip_strides=(4,), model_changes="allow")
    uri = _same_as_sync(names, steps, cfg)
    assert (4, 0) not in _objects(uri)


def test_a_base_that_does_not_rewind_stops_the_publisher(
    names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held word that differs from what the accumulator says was written (a stray write,
    an internal error) fails the settle that rebuilds the base, like any publish error:
    raised, and no skip patch coded from it."""
    monkeypatch.setattr(core, "SETTLE_AFTER_S", 3600.0)  # settled first thing in 4's build
    uri = _board(names)
    pub = Publisher(uri, RUN, PublisherConfig(format="bf16", skip_strides=(4,)))
    steps = _steps([0, 1, 2, 3, 4])
    try:
        for v, masters in steps[:4]:
            pub.publish(masters, v)
            pub.flush()
        pipe = pub._writer.pipe
        assert pipe._later is not None and pipe._later[1] is not None
        step = pipe._later[1]  # 2 -> 3, composed into the accumulator 0 -> 3 by the settle
        name = min(step.tensors)
        pos = int(step.tensors[name].changes().positions[0])
        pipe.prev[name].data.reshape(-1)[pos] ^= 1
        pub.publish(steps[4][1], 4)
        with pytest.raises(RollpatchError, match="base|rewind"):
            pub.flush()
        assert Board(uri).latest(RUN).version == 3
    finally:
        pub.close()  # flush() raised the error: close does not raise it again


@pytest.mark.parametrize(
    "cfg",
    [
        PublisherConfig(format="bf16", skip_strides=(4, 8), fold_every=8),
        PublisherConfig(format="bf16", skip_strides=(2, 4)),
        PublisherConfig(format="bf16", skip_strides=(4,), keyframe_every=4),
        PublisherConfig(format="bf16", skip_strides=(3,), fold_every=6),
    ],
    ids=["folds-cover-stride-8", "consecutive-skips", "keyframes-at-skips", "fold-and-stride"],
)
def test_other_schedules_write_the_sync_bytes(
    cfg: PublisherConfig, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folded patches landing on a skip base (not rebuilt: the fold is that patch), skip
    versions back to back (no settle between: composed as before), keyframes at skip
    versions: the same objects as a synchronous publisher, every version reconstructs."""
    monkeypatch.setattr(core, "SETTLE_AFTER_S", 0.0)
    rebuilt: list[int] = []
    real = pipeline.rebuild_ahead

    def counted(*args: object, **kw: object) -> object:
        r = real(*args, **kw)  # type: ignore[arg-type]
        if r is not None:
            rebuilt.append(r.base)
        return r

    monkeypatch.setattr(pipeline, "rebuild_ahead", counted)
    _same_as_sync(names, _steps(list(range(14)), seed=34), cfg)
    assert rebuilt  # some skip patch of the schedule came from a base rebuilt ahead
