"""Folded patches from anchors (``PublisherConfig.fold_every``), end to end on the built-in
engine: a follower at an anchor catches up by one patch that its engine decodes in place and
proves against the signed manifest; a follower off the anchors still takes the chain; a
tampered or mismatched folded patch is refused with the engine on its last version (and
planned around when the chain is there); a publisher that restarts inside a fold window never
publishes a fold from a base it does not hold.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollpatch import layout, native
from rollpatch.board import Board
from rollpatch.errors import RollpatchError
from rollpatch.follower import Follower
from rollpatch.formats import cast_view
from rollpatch.manifest import PatchObject
from rollpatch.patch import Patch, apply, decode, diff, encode
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct
from rollpatch.store import ObjectInfo, Store
from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root
from rollpatch.view import View
from tests.conftest import FAST_FOLLOWER

pytestmark = pytest.mark.skipif(native.core is None, reason="the native core is not built")

RUN = "fold"
FAST = FAST_FOLLOWER
#: Anchors at multiples of 4 (keyframes only at v0): v2, v3 fold from 0; v6, v7 from 4.
CFG = {"keyframe_every": 0, "skip_strides": (), "fold_every": 4}


@dataclasses.dataclass
class Run:
    board: Board
    trust: Trust
    signer: Signer
    views: list[View]


def _nudge(masters: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    """An RL-like step: ~4% of each tensor's values move by a few percent."""
    for m in masters.values():
        pick = rng.random(m.shape) < 0.04
        m[pick] *= np.float32(1) + rng.normal(0, 0.05, int(pick.sum())).astype(np.float32)


@pytest.fixture(scope="module")
def run(tiny_model: Path) -> Run:
    """Versions 0..7 of the tiny model on a signed memory board (folds from 0 and 4)."""
    from rollpatch.io.safetensors import load_view

    key = SigningKey.generate()
    signer = Signer(keys=(key,))
    trust = Trust(sign_root(Root.new([key.public]), [key]))
    board = Board(f"memory://fold-{os.getpid()}-{id(key)}")
    masters = {
        n: t.to_array().astype(np.float32)
        for n, t in load_view(tiny_model / "model.safetensors").items()
    }
    rng = np.random.default_rng(3)
    views = []
    with Publisher(board, RUN, PublisherConfig(signer=signer, **CFG), asynchronous=False) as pub:
        for v in range(8):
            if v:
                _nudge(masters, rng)
            assert pub.publish(masters) == v
            views.append(cast_view(masters, "bf16"))
    return Run(board, trust, signer, views)


@pytest.fixture
def engine(reference_engine: Any) -> Any:
    return reference_engine


def _boot(eng: Any, run: Run, v: int) -> list[list[int]]:
    """Load version ``v`` into ``eng`` and record the hops of every later stage_encoded."""
    eng.load(run.views[v].copy(), v)
    calls: list[list[int]] = []
    inner = eng.stage_encoded

    def stage_encoded(steps: Any, version: int) -> Any:
        calls.append([len(s.blobs) for s in steps])
        return inner(steps, version)

    eng.stage_encoded = stage_encoded
    return calls


def _fresh(eng: Any) -> str:
    """The engine's root digest re-hashed from its live words (no cached digest)."""
    return View({n: t for n, t in eng.runtime.view.items()}).digest()


def test_manifests_list_a_fold_from_the_anchor(run: Run) -> None:
    bases = {v: sorted({p.base for p in run.board.manifest(RUN, v).patches}) for v in range(8)}
    assert bases == {0: [], 1: [0], 2: [0, 1], 3: [0, 2], 4: [0, 3], 5: [4], 6: [4, 5], 7: [4, 6]}
    for v, base in ((3, 0), (7, 4)):  # the fold: encode(diff(anchor, v), anchor), byte for byte
        (po,) = run.board.manifest(RUN, v).patches_from(base)
        got = run.board.fetch(po.ref)
        d = diff(run.views[base], run.views[v])
        meta = {"run": RUN, "from": str(base), "to": str(v), "shard": "0"}
        assert got == encode(Patch(d.base, d.target, d.tensors, meta), run.views[base])
        assert po.base_digest == run.views[base].digest()
    assert reconstruct(run.board, RUN, 7, trust=run.trust).digest() == run.views[7].digest()


def test_a_follower_at_an_anchor_catches_up_by_one_folded_patch(run: Run, engine: Any) -> None:
    calls = _boot(engine, run, 0)
    board = Board(run.board.store, trust=run.trust)
    assert [(s.base, s.to) for s in board.plan(RUN, 0, 3).steps] == [(0, 3)]
    f = Follower(board, RUN, engine, FAST)
    assert f.sync(3) == 3 and calls == [[1]]  # one hop, one object, decoded in the engine
    assert engine.digest == run.views[3].digest() == _fresh(engine)
    for name, t in run.views[3].items():  # bit-exact
        assert np.array_equal(engine.runtime.view[name].data, t.data), name
    # off the anchors the chain still works: 3 -> 4 (a step), then 4 -> 7 (the fold from 4)
    assert [(s.base, s.to) for s in board.plan(RUN, 3, 6).steps] == [(3, 4), (4, 6)]
    assert [(s.base, s.to) for s in board.plan(RUN, 5, 7).steps] == [(5, 6), (6, 7)]
    assert f.sync(5) == 5 and calls[-1] == [1, 1]
    assert f.sync(7) == 7 and calls[-1] == [1, 1] and _fresh(engine) == run.views[7].digest()


class _Swapped(Store):
    """``inner`` with some objects' bytes replaced (``swap``) or missing (``gone``)."""

    writable = False

    def __init__(self, inner: Store, swap: dict[str, bytes], gone: set[str]) -> None:
        self.inner, self.swap, self.gone, self.uri = inner, swap, gone, inner.uri

    def _get(self, key: str) -> bytes:
        if key in self.gone:
            from rollpatch.errors import NotFoundError

            raise NotFoundError("gone", key=key)
        return self.swap.get(key) or self.inner.get(key)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self._get(key)[start:end]

    def _list(self, prefix: str) -> list[str]:
        return list(self.inner.list(prefix))

    def _head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        raise AssertionError("read-only")

    def _delete(self, key: str) -> None:
        raise AssertionError("read-only")

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        raise AssertionError("read-only")


def _mismatched_board(run: Run) -> tuple[Board, str]:
    """A copy of the run whose v3 manifest, signed by the run's own key (a publisher bug, not
    an outsider), lists as its fold from 0 a patch that binds v0 -> v3 but holds the change
    v1 -> v3 (encoded against v1's words)."""
    src = run.board.store
    dst = Board(f"memory://fold-bad-{os.getpid()}-{id(run)}", signer=run.signer)
    m3 = run.board.manifest(RUN, 3)
    for key in src.list(""):
        if key == layout.version_key(RUN, 3):
            continue
        dst.store.put(key, src.get(key), if_absent=False)
    wrong = diff(run.views[1], run.views[3])
    blob = encode(Patch(run.views[0].digest(), run.views[3].digest(), wrong.tensors), run.views[1])
    ref = dst.put_object(RUN, blob, "rpatch")
    patches = tuple(
        PatchObject(ref, 0, p.base_digest, p.shard) if p.base == 0 else p for p in m3.patches
    )
    dst.put_manifest(dataclasses.replace(m3, patches=patches))
    return Board(dst.store, trust=run.trust), ref.key


@pytest.mark.parametrize("how", ["tampered", "mismatched"])
@pytest.mark.parametrize("chain", [True, False])
def test_a_bad_folded_patch_is_refused(run: Run, engine: Any, how: str, chain: bool) -> None:
    """Tampered bytes (the store's) fail the manifest's BLAKE3; a signed patch whose change
    does not lead from its base to its target fails the engine's proof. Either way nothing
    is written: with the chain of steps there the follower plans around the object and
    reaches the version by the chain; without it (v0's other patches gone) the sync fails and
    the engine stays on its last verified version."""
    if how == "tampered":
        (po,) = run.board.manifest(RUN, 3).patches_from(0)
        bad = bytearray(run.board.fetch(po.ref))
        bad[len(bad) // 2] ^= 0x40
        store: Store = run.board.store
        board, key, swap = run.board, po.ref.key, {po.ref.key: bytes(bad)}
    else:
        board, key = _mismatched_board(run)
        store, swap = board.store, {}
    # without a chain: every other patch from v0 (the step to v1, the fold to v2) is gone
    others = [po.ref.key for v in (1, 2) for po in board.manifest(RUN, v).patches_from(0)]
    gone = set() if chain else set(others)
    reader = Board(_Swapped(store, swap, gone), trust=run.trust)
    assert [(s.base, s.to) for s in reader.plan(RUN, 0, 3).steps] == [(0, 3)]
    calls = _boot(engine, run, 0)
    written: list[int] = []
    commit = engine.commit_staged
    engine.commit_staged = lambda staged, v: (written.append(v), commit(staged, v))[1]
    f = Follower(reader, RUN, engine, FAST)
    if chain:
        assert f.sync(3) == 3 and written == [3]
        assert calls[-1] == [1, 1]  # around it: the fold to v2 and the step to v3
        assert key in frozenset(f._bad.keys())
        assert engine.digest == run.views[3].digest() == _fresh(engine)
    else:
        with pytest.raises(RollpatchError):  # the last path tried: an object that is gone
            f.sync(3)
        assert key in frozenset(f._bad.keys())
        assert written == []
        assert engine.version == 0 and engine.digest == run.views[0].digest() == _fresh(engine)
        assert f.version == 0


def test_a_publisher_restarting_inside_a_fold_window(tmp_path: Path) -> None:
    """Crash (no close) after v5, inside the window of anchor 4: the restarted publisher does
    not hold v4's view, so v6 and v7 get no fold (never one from a wrong base); v8 is an
    anchor again and v10 folds from it. A restart at an anchor (v8) folds from the resumed
    view. Every patch on the board decodes to its manifest's target."""
    rng = np.random.default_rng(11)
    masters = {f"layers.{i}.w": rng.standard_normal((64, 96)).astype(np.float32) for i in range(3)}
    board = Board(tmp_path.as_uri())
    views: dict[int, View] = {}

    def publish(pub: Publisher, v: int) -> None:
        if v:
            _nudge(masters, rng)
        assert pub.publish(masters) == v
        views[v] = cast_view(masters, "bf16")

    crashed = Publisher(board, RUN, PublisherConfig(**CFG), asynchronous=False)
    for v in range(6):
        publish(crashed, v)
    # the crash: the process is gone (its lease is taken at once on its host: here the
    # object lives on, so the restart takes the run over); a new publisher resumes
    with Publisher(board, RUN, PublisherConfig(**CFG, takeover=True), asynchronous=False) as pub:
        assert pub.last_durable == 5
        for v in range(6, 9):
            publish(pub, v)
    with Publisher(board, RUN, PublisherConfig(**CFG), asynchronous=False) as pub:
        assert pub.last_durable == 8
        for v in range(9, 11):
            publish(pub, v)
    bases = {v: sorted({p.base for p in board.manifest(RUN, v).patches}) for v in range(6, 11)}
    assert bases == {6: [5], 7: [6], 8: [7], 9: [8], 10: [8, 9]}
    for v in range(1, 11):
        m = board.manifest(RUN, v)
        assert m.target == views[v].digest()
        for po in m.patches:
            assert po.base_digest == views[po.base].digest()
            got = reconstruct(board, RUN, po.base)
            apply(got, decode(board.fetch(po.ref), got))  # verified against both digests
            assert got.digest() == m.target


def test_anchors_and_config() -> None:
    from rollpatch.errors import ConfigError

    cfg = PublisherConfig(keyframe_every=50, fold_every=8)
    assert [v for v in range(60) if cfg.is_anchor(v)] == [0, 8, 16, 24, 32, 40, 48, 50, 56]
    assert [cfg.anchor_below(v) for v in (1, 8, 9, 50, 51, 56, 57)] == [0, 0, 8, 48, 50, 50, 56]
    assert cfg.window == 8 and PublisherConfig(skip_strides=(16,), fold_every=8).window == 16
    assert not PublisherConfig().is_anchor(0) and PublisherConfig().fold_every == 0
    with pytest.raises(ConfigError, match="fold_every"):
        PublisherConfig(fold_every=1)
    with pytest.raises(ConfigError, match="fold_every"):
        PublisherConfig(fold_every=-8)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_the_device_path_publishes_the_same_folds(fmt: str) -> None:
    """The device path composes its fold in an accumulator, the host path encodes it from the
    anchor's view: the same objects and manifests, byte for byte."""
    import uuid

    from tests.test_publisher_device import _CHANGES, _board_bytes, _publish, _versions

    if fmt != "bf16":
        pytest.importorskip("ml_dtypes")
    skip = {"extra.norm.weight"} | ({"model.norm.weight"} if fmt != "bf16" else set())
    versions = [{k: a for k, a in v.items() if k not in skip} for v in _versions(7)]
    common: dict[str, Any] = {
        "format": fmt,
        "keyframe_every": 0,
        "skip_strides": (4,),
        "fold_every": 3,
        "publisher_id": "test",
        **_CHANGES,  # _versions' NaNs (BF16 keeps them): what the guards refuse by default
    }
    tag = uuid.uuid4().hex[:8]
    host = _publish(f"memory://fold-host-{tag}", PublisherConfig(**common), versions, False)
    dev = _publish(
        f"memory://fold-dev-{tag}", PublisherConfig(diff_on="device", **common), versions, True
    )
    h_objects, h_manifests = _board_bytes(host.board)
    d_objects, d_manifests = _board_bytes(dev.board)
    bases = [sorted({p["base"] for p in m["patches"]}) for m in h_manifests]
    assert bases == [[], [0], [0, 1], [0, 2], [0, 3], [3, 4], [3, 5]]
    assert h_manifests == d_manifests and h_objects == d_objects
    host.close()
    dev.close()
