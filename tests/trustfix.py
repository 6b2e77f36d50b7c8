"""The signed-board tests' world: :class:`Pub` (keys, a root, versions on a signing
``memory://`` board, each view kept for checks), followers holding a :class:`ViewEngine`
and a :class:`Trust` built from the root file a publisher would hand out, and
:func:`refused` (the follower refuses with a TrustError naming the attack and keeps its last
good version).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.engines import ViewEngine
from rollpatch.errors import TrustError
from rollpatch.follower import Follower, FollowerConfig, FollowerState
from rollpatch.kinds import KINDS
from rollpatch.manifest import KeyframeObject, Manifest, PatchObject
from rollpatch.patch import diff, encode
from rollpatch.store import MemoryStore
from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root
from rollpatch.view import Tensor, View
from tests.conftest import make_manifest

RUN = "rl"
FAST = FollowerConfig(poll_s=0.01, backoff_s=0.001, retries=1, timeout_s=10.0)


def make_view(seed: int) -> View:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(2048) * 0.02).astype(np.float32)
    return View(
        {"w": Tensor(KINDS["bf16"], (16, 128), (w.view(np.uint32) >> 16).astype(np.uint16))}
    )


def step_view(v: View, seed: int) -> View:
    data = v["w"].data.copy()
    idx = np.random.default_rng(seed).choice(data.size, 20, replace=False)
    data[idx] ^= np.uint16(1)
    return View({"w": Tensor(v["w"].kind, v["w"].shape, data)})


class Pub:
    """A signed board: keys, root 1 and versions 0..n, each view kept for checks."""

    def __init__(
        self, versions: int = 3, *, threshold: int = 1, nkeys: int = 1, ttl: float = 3600.0
    ) -> None:
        self.store = MemoryStore(f"trust-{uuid.uuid4().hex}")
        self.keys = [SigningKey.generate() for _ in range(nkeys)]
        self.signer = Signer(keys=tuple(self.keys), latest_ttl_s=ttl)
        self.board = Board(self.store, signer=self.signer)
        self.root = sign_root(
            Root.new([k.public for k in self.keys], threshold=threshold), self.keys
        )
        self.board.put_root(self.root)
        self.views: dict[int, View] = {}
        for n in range(versions):
            self.publish(n)

    def manifest_for(self, n: int) -> Manifest:
        view = self.views[n]
        if n == 0:
            ref = self.board.put_object(RUN, safetensors_bytes(view), "safetensors")
            return make_manifest(
                RUN,
                0,
                target=view.digest(),
                view_bytes=view.nbytes,
                keyframes=(KeyframeObject(ref),),
            )
        base = self.views[n - 1]
        ref = self.board.put_object(RUN, encode(diff(base, view), base), "rpatch")
        return make_manifest(
            RUN,
            n,
            target=view.digest(),
            view_bytes=view.nbytes,
            patches=(PatchObject(ref, n - 1, base.digest()),),
        )

    def publish(self, n: int, board: Board | None = None) -> Manifest:
        self.views[n] = make_view(0) if n == 0 else step_view(self.views[n - 1], n)
        b = board or self.board
        m = self.manifest_for(n)
        b.put_manifest(m)
        b.advance(RUN, n)
        return m

    def trust(self, tmp: Path | None = None, **kw: object) -> Trust:
        state = None if tmp is None else tmp / "state.json"
        return Trust(self.root, state_path=state, **kw)  # type: ignore[arg-type]


def safetensors_bytes(view: View) -> bytes:
    from rollpatch.io import view_to_bytes

    return view_to_bytes(view)


def follower(pub: Pub, trust: Trust) -> Follower:
    return Follower(Board(pub.store), RUN, ViewEngine(), FAST, trust=trust)


def refused(f: Follower, reason: str, want: int | None = None) -> TrustError:
    before = f.version
    with pytest.raises(TrustError) as info:
        f.sync(want)
    assert info.value.reason == reason, info.value
    st = f.status()
    assert st.state is FollowerState.ERROR and st.error_type == "TrustError"
    assert f.version == before  # the engine keeps its last good version
    return info.value


def put_raw(pub: Pub, key: str, raw: bytes) -> None:
    pub.store.put(key, raw, if_absent=False)
