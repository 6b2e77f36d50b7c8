"""An engine whose model cannot hold the run: refused from the keyframe's header, remembered
per keyframe, logged once (rollpatch.engines.fit, rollpatch.follower.failures).

The published board: tests/followfix.py (keyframes at 0 and, in 2 shards, at 20).
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import pytest

from rollpatch.board import Board
from rollpatch.engines import ViewEngine
from rollpatch.engines.fit import FitCheck, ModelTensors, tensors_of_kinds, tensors_of_view
from rollpatch.errors import EngineError, IncompatibleModelError
from rollpatch.follower import Follower, FollowerState
from rollpatch.follower.failures import REPEAT_LOG_S, FailureLog
from rollpatch.formats import cast_view
from rollpatch.store import Store
from tests.followfix import FAST, LAST, RUN, Published, assert_holds, board, published
from tests.relayfix import Counting
from tests.test_publisher_sharded_slices import masters

_FIXTURES = (board, published)  # used by name


class ShapedEngine(ViewEngine):
    """A view engine started with a model of ``tensors`` (before any load)."""

    def __init__(self, tensors: ModelTensors) -> None:
        super().__init__()
        self._tensors = tensors

    def model_tensors(self) -> ModelTensors:
        return self._tensors


class Bytes(Counting):
    """Counts the bytes read per key as well."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.nbytes: collections.Counter[str] = collections.Counter()

    def _get(self, key: str) -> bytes:
        got = super()._get(key)
        self.nbytes[key] += len(got)
        return got

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        got = super()._get_range(key, start, end)
        self.nbytes[key] += len(got)
        return got


def _world(board: Board, tensors: ModelTensors) -> tuple[Follower, ShapedEngine, Bytes]:
    store = Bytes(board.store)
    engine = ShapedEngine(tensors)
    return Follower(Board(store), RUN, engine, FAST), engine, store


def _keyframes(board: Board) -> dict[str, int]:
    """Every keyframe object of the run: key -> size."""
    out = {}
    for v in board.versions(RUN):
        for k in board.manifest(RUN, v).keyframes:
            out[k.ref.key] = k.ref.size
    return out


def _read(store: Bytes, keys: dict[str, int]) -> int:
    return sum(store.nbytes[k] for k in keys)


def test_a_model_of_other_shapes_is_refused_from_the_header(
    board: Board, published: Published
) -> None:
    tensors = dict(tensors_of_view(published.views[0]))
    tensors["layers.2.w"] = ("BF16", (64, 64))  # same size, other shape (shard 0 at v20)
    f, engine, store = _world(board, tensors)
    with pytest.raises(IncompatibleModelError) as e:
        f.sync()
    assert e.value.context["tensor"] == "layers.2.w"
    m = board.manifest(RUN, e.value.context["version"])
    assert e.value.context.get("run_format") == m.format  # a quantised run says so
    assert e.value.context["run_shape"] == (32, 128)
    assert e.value.context["engine_shape"] == (64, 64)
    assert "start the engine with the model this run trains" in str(e.value)
    st = f.status()
    assert st.state is FollowerState.ERROR and st.error_type == "IncompatibleModelError"
    assert (engine.version, st.version, st.failures) == (None, None, 1)
    kf = _keyframes(board)
    read = _read(store, kf)
    assert 0 < read < min(kf.values()) // 4  # a header, never the tensors
    plan = f.last_plan
    assert plan is not None and any(not s.is_keyframe for s in plan.steps)
    patches = [r.key for s in plan.steps if not s.is_keyframe for r in s.objects]
    assert sum(store.nbytes[k] for k in patches) == 0  # nor the patches after the keyframe
    assert st.bytes_fetched == 0


def test_a_run_tensor_the_model_lacks_is_refused_from_the_header(
    board: Board, published: Published
) -> None:
    tensors = dict(tensors_of_view(published.views[0]))
    del tensors["layers.q"]
    f, _, store = _world(board, tensors)
    with pytest.raises(IncompatibleModelError, match="the run has a tensor") as e:
        f.sync()
    assert e.value.context["tensor"] == "layers.q"
    kf = _keyframes(board)
    assert _read(store, kf) < sum(kf.values()) // 2


def test_a_model_tensor_the_run_lacks_is_found_once_then_remembered(
    board: Board, published: Published
) -> None:
    """Only found once every shard is read: the next retry raises it without a fetch."""
    tensors = dict(tensors_of_view(published.views[0]))
    tensors["lm_head.weight"] = ("BF16", (32, 128))
    f, engine, store = _world(board, tensors)
    with pytest.raises(IncompatibleModelError, match="1 tensor.s. the run does not") as e:
        f.sync()
    assert e.value.context["tensor"] == "lm_head.weight"
    kf = _keyframes(board)
    assert _read(store, kf) > 0
    store.nbytes.clear()
    for _ in range(3):
        with pytest.raises(IncompatibleModelError, match="1 tensor.s. the run does not"):
            f.sync()
    assert _read(store, kf) == 0  # remembered: no keyframe byte read again
    assert f.status().failures == 4 and engine.version is None


def test_an_engine_restarted_with_the_right_model_is_checked_again(
    board: Board, published: Published
) -> None:
    """The memory of an unfit keyframe is for the model it was found unfit for: an engine
    restarted with the run's model (its tensors now fit) syncs at the next retry, without a
    sidecar restart or a new keyframe."""
    wrong = dict(tensors_of_view(published.views[0]))
    wrong["lm_head.weight"] = ("BF16", (32, 128))
    f, engine, _ = _world(board, wrong)
    for _ in range(2):
        with pytest.raises(IncompatibleModelError):
            f.sync()
    engine._tensors = tensors_of_view(published.views[0])  # restarted with the right model
    assert f.sync() == LAST
    assert_holds(engine, published.views[LAST])


def test_a_fitting_model_syncs(board: Board, published: Published) -> None:
    f, engine, _ = _world(board, tensors_of_view(published.views[0]))
    assert f.sync() == LAST
    assert_holds(engine, published.views[LAST])
    st = f.status()
    assert (st.state, st.last_error, st.failures) == (FollowerState.IDLE, None, 0)


def test_fit_check_messages() -> None:
    check = FitCheck({"a": ("BF16", (2, 3))}, engine="e", run="r", version=7)
    check.tensor("a", "BF16", (2, 3))
    check.names(["a"])
    with pytest.raises(IncompatibleModelError, match="differs") as e:
        check.tensor("a", "F16", (2, 3))
    assert e.value.context["run_dtype"] == "F16" and e.value.context["version"] == 7
    with pytest.raises(IncompatibleModelError, match="the run has 1 tensor"):
        check.names(["a", "b"])
    with pytest.raises(IncompatibleModelError, match="the engine's model has 1 tensor"):
        check.names([])
    assert issubclass(IncompatibleModelError, EngineError)  # callers catching it still do


def test_tensors_of_kinds_is_what_the_engines_report() -> None:
    """The vLLM and SGLang extensions list ``name -> [kind, shape]``."""
    got = tensors_of_kinds({"w": ["bf16", [4, 8]], "q": ["e4m3", [2]], "p": ["e2m1x2", [3, 4]]})
    assert got == {"w": ("BF16", (4, 8)), "q": ("F8_E4M3", (2,)), "p": ("U8", (3, 4))}


def test_the_reference_engine_lists_its_tensors(reference_engine: object) -> None:
    from rollpatch.engines.reference import ReferenceEngine

    assert isinstance(reference_engine, ReferenceEngine)
    held = reference_engine.model_tensors()
    view = reference_engine.runtime.view
    assert held == tensors_of_view(view) and len(held) == len(view)


def test_a_repeated_failure_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("rollpatch.test.failures")
    clock = [1000.0]
    flog = FailureLog(log, "r1", clock=lambda: clock[0])
    unfit = IncompatibleModelError("a tensor differs", tensor="w")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for _ in range(5):
            flog.failed(unfit)
            clock[0] += 1
        flog.failed(EngineError("another"))  # a different failure: logged at once
        flog.failed(EngineError("another"))
        clock[0] += REPEAT_LOG_S
        flog.failed(EngineError("another"))  # after the quiet period, with the count
        flog.cleared()
        flog.failed(EngineError("another"))  # after a success: at once
    lines = [
        (r.levelno, r.rp_event, r.rp_fields)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.levelno > logging.DEBUG
    ]
    assert [(lvl, name) for lvl, name, _ in lines] == [
        (logging.ERROR, "sync_failed"),
        (logging.WARNING, "sync_failed"),
        (logging.WARNING, "sync_failed"),
        (logging.INFO, "sync_recovered"),  # the success that ended 8 failures says so
        (logging.WARNING, "sync_failed"),
    ]
    first = lines[0][2]
    assert first["run"] == "r1" and first["error_type"] == "IncompatibleModelError"
    assert first["error"].startswith("a tensor differs")
    assert lines[2][2]["repeated"] == 1 and "since" in lines[2][2]  # the count, after the quiet
    assert lines[3][2]["failures"] == 8 and lines[3][2]["failed_for_s"] > REPEAT_LOG_S
    assert "repeated" not in lines[4][2]


def test_sliced_keyframes_are_checked_whole_before_any_fetch(tmp_path: Path) -> None:
    """A sliced tensor's shards hold slices: its whole shape (from the signed manifest) is
    checked before anything is read; a fitting model boots from the slices as before."""
    from tests.test_publisher_sharded_slices import CFG, publish_versions
    from tests.test_publisher_sharded_slices import RUN as SLICED

    board = Board(tmp_path.as_uri())
    publish_versions(board, range(5), CFG)
    want = tensors_of_view(cast_view(masters(4), "bf16"))
    bad = {**want, "w.a": ("BF16", (48, 64))}
    store = Bytes(board.store)
    f = Follower(Board(store), SLICED, ShapedEngine(bad))
    with pytest.raises(IncompatibleModelError, match="differs") as e:
        f.sync(4)
    assert e.value.context["tensor"] == "w.a" and e.value.context["run_shape"] == (64, 48)
    assert not any(k.endswith(".safetensors") for k in store.nbytes)  # not one keyframe byte
    good = Follower(board, SLICED, ShapedEngine(want))
    assert good.sync(4) == 4
    assert good.engine.words().digest() == board.manifest(SLICED, 4).target


@pytest.mark.parametrize("change", ["added", "reshaped"])
def test_a_version_the_model_cannot_hold_keeps_the_engine_serving(
    reference_engine: object, tmp_path: Path, change: str
) -> None:
    """A version that adds or reshapes a tensor cannot be staged by an engine whose model is
    fixed: the engine keeps its verified version (no reboot from a keyframe that cannot load
    either), the sync fails with IncompatibleModelError naming the tensor."""
    import numpy as np

    from rollpatch.engines.reference import ReferenceEngine
    from rollpatch.publisher import Publisher, PublisherConfig

    assert isinstance(reference_engine, ReferenceEngine)
    board = Board(tmp_path.as_uri())
    masters = {n: t.to_array().astype(np.float32) for n, t in reference_engine.runtime.view.items()}
    cfg = PublisherConfig(format="bf16", model_changes="allow")  # the publisher lets it through
    with Publisher(board, "r", cfg, asynchronous=False) as pub:
        pub.publish(masters)
        f = Follower(board, "r", reference_engine, FAST)
        assert f.sync() == 0
        nxt = dict(masters)
        if change == "added":
            nxt["extra.weight"] = np.ones((8, 8), np.float32)
            name = "extra.weight"
        else:
            name = "model.norm.weight"
            nxt[name] = np.ones(nxt[name].size + 4, np.float32)
        pub.publish(nxt)
    with pytest.raises(IncompatibleModelError) as e:
        f.sync()
    assert e.value.context["tensor"] == name
    st = f.status()
    assert (f.version, reference_engine.version, st.version, st.reboots) == (0, 0, 0, 0)
    assert st.error_type == "IncompatibleModelError"


def test_a_failure_whose_context_measures_time_is_still_the_same_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An expired LATEST is refused with how long ago it expired, a number that grows on
    every retry: still one line, not one per retry; a different version is another failure."""
    from rollpatch.errors import TrustError

    log = logging.getLogger("rollpatch.test.failures2")
    flog = FailureLog(log, "r1")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for ago in (0.4, 1.4, 3.4, 7.4):
            flog.failed(
                TrustError("LATEST has expired", reason="expired", version=5, expired_s_ago=ago)
            )
        flog.failed(
            TrustError("LATEST has expired", reason="expired", version=6, expired_s_ago=9.0)
        )
    lines = [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG]
    assert len(lines) == 2 and "expired_s_ago=0.4" in lines[0] and "version=6" in lines[1]


def test_an_error_shows_at_most_a_bounded_piece_of_each_context_value() -> None:
    from rollpatch.errors import MAX_CONTEXT_CHARS, ViewError

    text = str(ViewError("bad tensor name", tensor="x" * 100_000))
    assert len(text) < MAX_CONTEXT_CHARS + 100 and "(100,002 characters)" in text
