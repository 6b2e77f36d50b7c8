"""Adopting the version an engine booted with (``FollowerConfig.boot="adopt"``,
rollpatch/follower/adopt.py): no keyframe fetched when the engine's words are a published
version; the usual keyframe boot when they are none; one hash per stretch without a version;
the sidecar reports it. The built-in engine here; vLLM and SGLang in their live sidecar tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from rollpatch.board import Board
from rollpatch.errors import BaseMismatchError, EngineError
from rollpatch.follower import Follower
from rollpatch.follower.adopt import candidates
from rollpatch.formats import cast_view
from rollpatch.io.safetensors import load_view, save_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.view import View
from tests.conftest import FAST_FOLLOWER

RUN = "rl"
LAST = 5
ADOPT = dataclasses.replace(FAST_FOLLOWER, boot="adopt")


@dataclasses.dataclass
class Run:
    board: str
    views: list[View]


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Versions 0..LAST of the tiny model (version 0: its own words; a keyframe only there)."""
    masters = {
        n: t.to_array().astype(np.float32)
        for n, t in load_view(tiny_model / "model.safetensors").items()
    }
    board = f"file://{tmp_path_factory.mktemp('adopt') / 'board'}"
    rng = np.random.default_rng(5)
    views = []
    with Publisher(board, RUN, PublisherConfig(keyframe_every=0), asynchronous=False) as pub:
        for v in range(LAST + 1):
            if v:
                for m in masters.values():
                    pick = rng.random(m.shape) < 0.03
                    m[pick] *= np.float32(1.05)
            assert pub.publish(masters) == v
            views.append(cast_view(masters, "bf16"))
    assert views[0].digest() == load_view(tiny_model / "model.safetensors").digest()
    return Run(board, views)


def _booted_from(tiny_model: Path, tmp_path: Path, view: View) -> Path:
    """A copy of the tiny model's directory whose weights are ``view`` (as ``rollpatch pull``
    writes it, put in place of the checkpoint)."""
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    save_view(view, d / "model.safetensors")
    return d


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ReferenceEngine.boot_digest call, counted (the O(N) hash an adoption costs)."""
    from rollpatch.engines.reference import ReferenceEngine

    calls: list[int] = []
    real = ReferenceEngine.boot_digest

    def boot_digest(self: Any) -> str:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(ReferenceEngine, "boot_digest", boot_digest)
    return calls


@contextlib.contextmanager
def _engine(model: Path) -> Iterator[Any]:
    from rollpatch.engines.reference import ReferenceEngine

    eng = ReferenceEngine.from_dir(model, threads=1, serve_http=False)
    try:
        yield eng
    finally:
        eng.close()


def _patch_bytes(board: Board, have: int, want: int) -> int:
    return sum(
        p.ref.size for v in range(have + 1, want + 1) for p in board.manifest(RUN, v).patches
    )


def _exact(eng: Any, view: View) -> None:
    live = View(dict(eng.runtime.view.items()))
    live.invalidate()
    assert eng.digest == view.digest() == live.digest()
    for name, t in view.items():
        assert np.array_equal(eng.runtime.view[name].data, t.data), name


def test_candidates_newest_then_keyframes_then_the_first() -> None:
    assert candidates(range(10), [0, 4, 8], 3) == [9, 8, 7, 4, 0]
    assert candidates([3, 4, 5], [3], 8) == [5, 4, 3]
    assert candidates([], [], 4) == []
    # a keyframe marker without a manifest (gc'd) is not read; at most 2 * scan + 1
    assert candidates(range(100), [1, 2, 3, 50, 101], 2) == [99, 98, 50, 3, 0]
    assert candidates(range(10), [0, 8], 3, upto=6) == [6, 5, 4, 0]  # nothing above LATEST


@pytest.mark.parametrize("booted", [0, 2])
def test_an_engine_booted_from_a_published_version_is_adopted(
    run: Run, tiny_model: Path, tmp_path: Path, counted: list[int], booted: int
) -> None:
    """Booted from version ``booted``'s view: the follower hashes the engine's words once,
    adopts that version and catches up by patches alone (no keyframe byte fetched)."""
    model = tiny_model if booted == 0 else _booted_from(tiny_model, tmp_path, run.views[booted])
    with _engine(model) as eng:
        f = Follower(run.board, RUN, eng, ADOPT)
        assert f.sync() == LAST
        st = f.status()
        assert (st.adoptions, st.reboots, st.commits) == (1, 0, 1)
        plan = f.last_plan
        assert plan is not None and plan.have == booted
        assert not any(s.is_keyframe for s in plan.steps)
        assert st.bytes_fetched == _patch_bytes(Board(run.board), booted, LAST)
        assert len(counted) == 1
        _exact(eng, run.views[LAST])


def test_an_engine_booted_from_the_latest_version_fetches_nothing(
    run: Run, tiny_model: Path, tmp_path: Path
) -> None:
    model = _booted_from(tiny_model, tmp_path, run.views[LAST])
    with _engine(model) as eng:
        f = Follower(run.board, RUN, eng, ADOPT)
        assert f.sync() == LAST and f.version == LAST
        st = f.status()
        assert (st.adoptions, st.commits, st.bytes_fetched, st.objects_fetched) == (1, 0, 0, 0)
        assert eng.version == LAST


def test_words_that_are_no_version_boot_from_a_keyframe_hashed_once(
    run: Run, tiny_model: Path, tmp_path: Path, counted: list[int]
) -> None:
    """Words that match no published version: one hash, then the keyframe; a later sync
    (the engine verified) hashes nothing; losing the version gets one attempt again, which
    adopts what the engine still holds."""
    odd = run.views[1].copy()
    name = min(odd)
    odd[name].data.view(np.uint8)[0] ^= 1
    with _engine(_booted_from(tiny_model, tmp_path, odd)) as eng:
        f = Follower(run.board, RUN, eng, ADOPT)
        assert f.sync(3) == 3
        st = f.status()
        assert st.adoptions == 0 and len(counted) == 1
        plan = f.last_plan
        assert plan is not None and plan.steps[0].is_keyframe
        assert f.sync(4) == 4 and len(counted) == 1  # verified: nothing hashed
        eng.runtime.version = None  # a restart would leave words it cannot vouch for
        assert f.sync() == LAST
        assert f.status().adoptions == 1 and len(counted) == 2
        assert f.last_plan is not None and f.last_plan.have == 4
        _exact(eng, run.views[LAST])


def test_boot_keyframe_never_hashes(run: Run, tiny_model: Path, counted: list[int]) -> None:
    with _engine(tiny_model) as eng:
        f = Follower(run.board, RUN, eng, FAST_FOLLOWER)  # boot="keyframe", the default
        assert f.sync() == LAST
        assert not counted and f.status().adoptions == 0
        assert f.last_plan is not None and f.last_plan.steps[0].is_keyframe


def test_an_engine_that_cannot_hash_boots_from_a_keyframe(run: Run) -> None:
    from rollpatch.engines import ViewEngine

    eng = ViewEngine()  # boot_digest: None
    with pytest.raises(EngineError, match="cannot adopt"):
        eng.adopt(0, run.views[0].digest())
    f = Follower(run.board, RUN, eng, ADOPT)
    assert f.sync() == LAST and f.status().adoptions == 0
    assert eng.digest == run.views[LAST].digest()


def test_adopt_refuses_other_words_and_changes_nothing(run: Run, tiny_model: Path) -> None:
    with _engine(tiny_model) as eng:
        with pytest.raises(BaseMismatchError, match="expected view"):
            eng.adopt(1, run.views[1].digest())
        assert eng.version is None
        eng.adopt(0, run.views[0].digest())
        assert eng.version == 0 and eng.digest == run.views[0].digest()


def test_the_sidecar_cli_adopts_and_reports_it(run: Run, tiny_model: Path, tmp_path: Path) -> None:
    """``rollpatch sidecar --engine reference --model DIR --boot adopt``, its own process:
    ready on LATEST with only the patches fetched; /version and /metrics count the adoption."""
    from tests.conftest import free_port
    from tests.sidecarworld import spawn, wait_ready

    model = _booted_from(tiny_model, tmp_path, run.views[3])
    port = free_port()
    args = ["--engine", "reference", "--model", str(model), "--threads", "1"]
    args += ["--boot", "adopt", "--port", str(port), "--poll", "0.05"]
    with spawn(run.board, RUN, tmp_path, args) as (proc, log):
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, log, url, 120)
        v = httpx.get(f"{url}/version").json()
        assert (v["served"], v["adoptions"], v["commits"]) == (LAST, 1, 1)
        assert v["bytes_fetched"] == _patch_bytes(Board(run.board), 3, LAST)
        metrics = httpx.get(f"{url}/metrics").text
        assert "rollpatch_adoptions_total 1.0" in metrics
    text = log.read_text(errors="replace")
    assert f"{RUN}@3: adopted the engine's words" in text and "no keyframe fetched" in text


def test_an_engine_not_up_yet_is_asked_again(run: Run, tiny_model: Path) -> None:
    """boot_digest failing (the engine not reachable yet) is no answer: the next sync asks
    again and adopts, instead of booting from a keyframe for good."""
    with _engine(tiny_model) as eng:
        real, calls = eng.boot_digest, []

        def flaky() -> str:
            calls.append(1)
            if len(calls) == 1:
                raise EngineError("connection refused", engine="reference")
            return real()

        eng.boot_digest = flaky
        load = eng.load

        def down(view: View, version: int) -> None:  # the keyframe boot fails too, once
            eng.load = load
            raise EngineError("connection refused", engine="reference")

        eng.load = down
        f = Follower(run.board, RUN, eng, ADOPT)
        with pytest.raises(EngineError, match="connection refused"):
            f.sync()
        assert f.sync() == LAST and len(calls) == 2
        st = f.status()
        assert st.adoptions == 1 and f.last_plan is not None and f.last_plan.have == 0


def test_a_version_above_latest_is_not_adopted(run: Run, tiny_model: Path, tmp_path: Path) -> None:
    """LATEST at 3 while the manifests of 4 and 5 are on the board (a publisher that died
    between its manifest and LATEST): an engine holding 5's words is not adopted as 5, a
    version the run does not name yet; it boots from a keyframe to LATEST."""
    import shutil as sh

    from rollpatch.layout import pointer_key

    src = Board(run.board)
    copy = tmp_path / "board"
    sh.copytree(run.board.removeprefix("file://"), copy)
    board = Board(f"file://{copy}")
    src_pointer = src.store.get(pointer_key(RUN))
    board.store.delete(pointer_key(RUN))
    board.advance(RUN, 3)
    assert board.latest(RUN).version == 3  # type: ignore[union-attr]
    with _engine(_booted_from(tiny_model, tmp_path, run.views[LAST])) as eng:
        f = Follower(board.store.uri, RUN, eng, ADOPT)
        assert f.sync() == 3
        assert f.status().adoptions == 0 and f.status().failures == 0
        _exact(eng, run.views[3])
    assert src.store.get(pointer_key(RUN)) == src_pointer


def test_words_an_audit_found_are_re_synced_from_a_keyframe_not_adopted(
    run: Run, tiny_model: Path, tmp_path: Path
) -> None:
    """An audit finds live words that differ from the adopted version: the island used to
    adopt again at once, and where what the adoption hashes is not all the kernels serve
    (vLLM's CPU-packed experts, found by an audit, session 39) it flapped 503/200 over
    corrupt weights. Now such an island is re-synced from a keyframe; it adopts again only
    after that (a later restart). Here the flipped word is put back before the re-sync: the
    words hash to the version again, as the packed case's plain words do."""
    model = _booted_from(tiny_model, tmp_path, run.views[LAST])
    with _engine(model) as eng:
        f = Follower(run.board, RUN, eng, dataclasses.replace(ADOPT, audit_bytes_per_s=1e9))
        assert f.sync() == LAST and f.status().adoptions == 1
        name = next(iter(run.views[LAST]))
        words = eng.runtime.view[name].data.reshape(-1)
        words[0] ^= 1  # behind every digest
        assert f.auditor is not None
        while f.auditor.mismatches == 0:
            assert f.auditor.step() is not None
        assert f.version is None
        words[0] ^= 1  # the plain words are the version's again
        assert f.sync() == LAST
        plan = f.last_plan  # a keyframe, not a second adoption
        assert f.status().adoptions == 1 and plan is not None and plan.steps[0].is_keyframe
        _exact(eng, run.views[LAST])
