"""Signed boards under a root of trust (issue 11): every attack on signing and LATEST.

Boards are ``memory://`` stores written through a signing :class:`Board`; followers hold a
:class:`ViewEngine` and a :class:`Trust` built from the root file a publisher would hand out.
Each test names the attack it replays; the follower must refuse it with a TrustError whose
``reason`` names it, keep its last good version, and take the next honest version.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from rollpatch.board import Board, pointer_key, root_key, version_key
from rollpatch.engines import ViewEngine
from rollpatch.errors import ConfigError, ManifestError, TrustError
from rollpatch.follower import Follower, FollowerConfig, FollowerState
from rollpatch.kinds import KINDS
from rollpatch.latest import encode_latest
from rollpatch.manifest import KeyframeObject, Manifest, PatchObject
from rollpatch.patch import diff, encode
from rollpatch.store import MemoryStore
from rollpatch.trust import (
    LATEST_TYPE,
    MANIFEST_TYPE,
    Root,
    Signer,
    SigningKey,
    Trust,
    load_envelope,
    seal,
    sign_root,
)
from rollpatch.types import Pointer
from rollpatch.view import Tensor, View
from tests.conftest import make_manifest

RUN = "rl"
FAST = FollowerConfig(poll_s=0.01, backoff_s=0.001, retries=1, timeout_s=10.0)


def _view(seed: int) -> View:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(2048) * 0.02).astype(np.float32)
    return View(
        {"w": Tensor(KINDS["bf16"], (16, 128), (w.view(np.uint32) >> 16).astype(np.uint16))}
    )


def _step(v: View, seed: int) -> View:
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
            ref = self.board.put_object(RUN, _safetensors(view), "safetensors")
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
        self.views[n] = _view(0) if n == 0 else _step(self.views[n - 1], n)
        b = board or self.board
        m = self.manifest_for(n)
        b.put_manifest(m)
        b.advance(RUN, n)
        return m

    def trust(self, tmp: Path | None = None, **kw: object) -> Trust:
        state = None if tmp is None else tmp / "state.json"
        return Trust(self.root, state_path=state, **kw)  # type: ignore[arg-type]


def _safetensors(view: View) -> bytes:
    from rollpatch.io import view_to_bytes

    return view_to_bytes(view)


def _follower(pub: Pub, trust: Trust) -> Follower:
    return Follower(Board(pub.store), RUN, ViewEngine(), FAST, trust=trust)


def _refused(f: Follower, reason: str, want: int | None = None) -> TrustError:
    before = f.version
    with pytest.raises(TrustError) as info:
        f.sync(want)
    assert info.value.reason == reason, info.value
    st = f.status()
    assert st.state is FollowerState.ERROR and st.error_type == "TrustError"
    assert f.version == before  # the engine keeps its last good version
    return info.value


def _put(pub: Pub, key: str, raw: bytes) -> None:
    pub.store.put(key, raw, if_absent=False)


def test_signed_board_is_followed_bit_exactly(tmp_path: Path) -> None:
    pub = Pub(4)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 3
    assert f.engine.digest == pub.views[3].digest()
    env = load_envelope(pub.store.get(version_key(RUN, 3)), expect=MANIFEST_TYPE, max_bytes=1 << 20)
    assert json.loads(env.payload)["target"] == pub.views[3].digest()


def test_forged_manifest_signed_by_an_outside_key_is_refused(tmp_path: Path) -> None:
    """Anyone who can write to the store: a new version signed with their own key."""
    pub = Pub(2)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 1
    mallory = Board(pub.store, signer=Signer(keys=(SigningKey.generate(),)))
    pub.publish(2, board=mallory)
    fetched = f.status().objects_fetched
    err = _refused(f, "bad_signature")  # its LATEST
    assert "0 valid signature" in str(err) and err.context["what_doc"] == "LATEST"
    err = _refused(f, "bad_signature", 2)  # its manifest, asked for by number
    assert err.context["what_doc"] == "manifest"
    assert f.engine.digest == pub.views[1].digest()
    assert f.status().objects_fetched == fetched  # nothing of the forged version was fetched


def test_unsigned_manifest_and_latest_on_a_signed_run_are_refused(tmp_path: Path) -> None:
    """A follower without a key accepted unsigned manifests; LATEST was never signed."""
    pub = Pub(2)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 1
    pub.publish(2, board=Board(pub.store))  # a bare manifest and a bare LATEST
    assert "LATEST is not signed" in str(_refused(f, "unsigned"))
    _put(
        pub,
        pointer_key(RUN),
        encode_latest(
            Pointer(RUN, 2, version_key(RUN, 2), pub.views[2].digest()), pub.signer, time.time()
        ),
    )
    err = _refused(f, "unsigned")
    assert "manifest is not signed" in str(err)
    assert f.engine.digest == pub.views[1].digest()


def test_tampered_payload_under_a_valid_signature_is_refused(tmp_path: Path) -> None:
    """Mix-and-match: swap the target digest / an object entry, keep the signatures."""
    pub = Pub(3)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync(1) == 1
    doc = json.loads(pub.store.get(version_key(RUN, 2)))
    payload = json.loads(base64.b64decode(doc["payload"]))
    payload["patches"][0]["b3"] = payload["patches"][0]["b3"][::-1]
    doc["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    _put(pub, version_key(RUN, 2), json.dumps(doc).encode())
    _refused(f, "bad_signature", 2)


def test_manifest_moved_to_another_versions_key_is_refused(tmp_path: Path) -> None:
    """A validly signed manifest of version 1 stored as version 2 (run/version are bound)."""
    pub = Pub(3)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync(1) == 1
    _put(pub, version_key(RUN, 2), pub.store.get(version_key(RUN, 1)))
    with pytest.raises(ManifestError, match="names another version"):
        f.sync(2)
    assert f.version == 1


def test_envelope_of_another_type_is_refused(tmp_path: Path) -> None:
    """A signed manifest served as LATEST: the payload type is signed too."""
    pub = Pub(2)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 1
    _put(pub, pointer_key(RUN), pub.store.get(version_key(RUN, 1)))
    _refused(f, "bad_signature")


def test_latest_pointed_back_is_a_rollback_also_after_a_restart(tmp_path: Path) -> None:
    """Pointing LATEST back to version 1 (a validly signed old pointer, replayed)."""
    pub = Pub(2)
    old = pub.store.get(pointer_key(RUN))
    pub.publish(2)
    pub.publish(3)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 3
    _put(pub, pointer_key(RUN), old)
    err = _refused(f, "rollback")
    assert err.context["verified"] == 3 and f.engine.digest == pub.views[3].digest()
    # a restarted follower (fresh engine, same state file) refuses it too
    again = _follower(pub, pub.trust(tmp_path))
    with pytest.raises(TrustError, match="rollback"):
        again.sync()
    assert again.engine.version is None
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["latest"] == {RUN: 3}


def test_frozen_latest_expires(tmp_path: Path) -> None:
    """Nothing detected a frozen LATEST: a signed pointer replayed past its expiry."""
    pub = Pub(2, ttl=60.0)
    now = [time.time()]
    f = _follower(pub, pub.trust(tmp_path, clock=lambda: now[0]))
    assert f.sync() == 1
    now[0] += 120  # the publisher stopped re-signing (or an attacker froze the pointer)
    err = _refused(f, "expired")
    assert "frozen" in str(err)
    now[0] = time.time() + 30  # the publisher's heartbeat re-signs the same version
    pub.board.advance(RUN, 1, refresh=True)
    assert f.sync() == 1 and f.status().state is FollowerState.IDLE


def test_heartbeat_resigns_the_same_version() -> None:
    pub = Pub(1, ttl=60.0)
    first = load_envelope(pub.store.get(pointer_key(RUN)), expect=LATEST_TYPE, max_bytes=1 << 16)
    time.sleep(0.01)
    p = pub.board.advance(RUN, 0, refresh=True)
    assert p.version == 0
    second = load_envelope(pub.store.get(pointer_key(RUN)), expect=LATEST_TYPE, max_bytes=1 << 16)
    e1, e2 = (json.loads(e.payload)["expires"] for e in (first, second))
    assert e2 > e1
    raw = pub.store.get(pointer_key(RUN))
    pub.board.advance(RUN, 0)  # without refresh: an equal version leaves LATEST alone
    assert pub.store.get(pointer_key(RUN)) == raw


def test_a_followers_material_cannot_mint_versions(tmp_path: Path) -> None:
    """With HMAC every follower's key could sign; a trust root holds public keys only."""
    pub = Pub(1)
    doc = json.loads(base64.b64decode(json.loads(pub.root)["payload"]))
    assert set(doc["keys"][pub.keys[0].keyid]) == {"keytype", "public"}
    assert b"PRIVATE" not in pub.root


def test_threshold_needs_distinct_keys(tmp_path: Path) -> None:
    pub = Pub(1, threshold=2, nkeys=2)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 0
    one = Board(pub.store, signer=Signer(keys=(pub.keys[0],)))
    pub.publish(1, board=one)
    err = _refused(f, "bad_signature")
    assert "2 needed" in str(err)
    # the same key twice in an envelope counts once
    raw = json.loads(pub.store.get(pointer_key(RUN)))
    raw["signatures"] = raw["signatures"] * 2
    _put(pub, pointer_key(RUN), json.dumps(raw).encode())
    _refused(f, "bad_signature")


def _rotate(
    pub: Pub, new: list[SigningKey], signers: list[SigningKey], version: int = 2, threshold: int = 1
) -> bytes:
    raw = sign_root(
        Root.new([k.public for k in new], threshold=threshold, version=version), signers
    )
    _put(pub, root_key(version), raw)
    return raw


def test_rotation_is_followed_and_a_revoked_key_refused(tmp_path: Path) -> None:
    pub = Pub(2)
    f = _follower(pub, pub.trust(tmp_path, root_check_s=0.0))
    assert f.sync() == 1
    new = SigningKey.generate()
    _rotate(pub, [new], [pub.keys[0], new])  # root 2, signed by root 1's key and its own
    pub.board = Board(pub.store, signer=Signer(keys=(new,)))
    pub.publish(2)
    assert f.sync() == 2  # manifests were re-verified under root 2 (new key)
    assert f.board.trust is not None and f.board.trust.root.version == 2
    # the old key is revoked: what it signs now is refused
    pub.board = Board(pub.store, signer=Signer(keys=(pub.keys[0],)))
    pub.publish(3)
    _refused(f, "bad_signature")
    # root rollback: the board loses root 2; a restarted follower keeps it from its state
    pub.store.delete(root_key(2))
    again = _follower(pub, pub.trust(tmp_path))
    assert again.board.trust is not None and again.board.trust.root.version == 2
    with pytest.raises(TrustError):
        again.sync(3)


def test_a_root_not_signed_by_the_previous_keys_is_refused(tmp_path: Path) -> None:
    pub = Pub(2)
    f = _follower(pub, pub.trust(tmp_path, root_check_s=0.0))
    assert f.sync() == 1
    mallory = SigningKey.generate()
    _rotate(pub, [mallory], [mallory])  # self-signed only
    pub.board = Board(pub.store, signer=Signer(keys=(mallory,)))
    pub.publish(2)
    _refused(f, "root")
    assert f.engine.digest == pub.views[1].digest()


def test_expired_root_refuses_everything(tmp_path: Path) -> None:
    pub = Pub(1)
    raw = sign_root(Root.new([pub.keys[0].public], expires=time.time() - 1), pub.keys)
    f = Follower(Board(pub.store), RUN, ViewEngine(), FAST, trust=Trust(raw))
    _refused(f, "root")


def test_initial_root_must_be_self_signed() -> None:
    a, b = SigningKey.generate(), SigningKey.generate()
    raw = sign_root(Root.new([a.public]), [b])
    with pytest.raises(TrustError, match="bad_signature|valid signature"):
        Trust(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[" * 10_000,
        b'{"payload": 1}',
        b'{"payload": "!!", "payloadType": "x", "signatures": []}',
        json.dumps(
            {
                "payload": "",
                "payloadType": LATEST_TYPE,
                "signatures": [{"keyid": "a" * 64, "sig": "%%"}],
            }
        ).encode(),
    ],
)
def test_hostile_latest_envelopes_are_refused_cleanly(tmp_path: Path, raw: bytes) -> None:
    pub = Pub(1)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 0
    _put(pub, pointer_key(RUN), raw)
    with pytest.raises(ManifestError):
        f.sync()
    assert f.version == 0


def test_state_file_damage_is_an_error_not_a_reset(tmp_path: Path) -> None:
    pub = Pub(1)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 0
    (tmp_path / "state.json").write_text('{"schema": "rollpatch.trust-state/1", "latest": 5}')
    with pytest.raises(ConfigError, match="delete it"):
        pub.trust(tmp_path)
    other = Pub(1)
    (tmp_path / "state.json").unlink()
    pub.trust(tmp_path)  # deleting it on purpose starts over
    assert Trust(other.root, state_path=tmp_path / "state.json").highest(RUN) is None


def test_without_trust_a_signed_board_still_reads_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub = Pub(2)
    run = f"r-{uuid.uuid4().hex[:8]}"  # the warning is once per service and process
    with caplog.at_level("WARNING", logger="rollpatch.trust"):
        Follower(Board(pub.store), run, ViewEngine(), FAST)
        Follower(Board(pub.store), run, ViewEngine(), FAST)
    lines = [r.getMessage() for r in caplog.records if run in r.getMessage()]
    assert len(lines) == 1 and "verification is OFF" in lines[0]
    f = Follower(Board(pub.store), RUN, ViewEngine(), FAST)
    assert f.sync() == 1 and f.engine.digest == pub.views[1].digest()


def test_seal_needs_a_key_and_signer_hides_secrets() -> None:
    with pytest.raises(ValueError):
        seal(MANIFEST_TYPE, b"x", [])
    k = SigningKey.generate()
    assert "PRIVATE" not in repr(Signer(keys=(k,))) and k.keyid[:16] in repr(k)
    with pytest.raises(ConfigError, match="latest_ttl_s"):
        Signer(keys=(k,), latest_ttl_s=0)
    with pytest.raises(ConfigError, match="twice"):
        Signer(keys=(k, k))


def test_an_idle_signing_publisher_keeps_latest_fresh(tmp_path: Path) -> None:
    """The publisher re-signs LATEST between versions; a follower never sees it expire."""
    from rollpatch.publisher import Publisher, PublisherConfig

    pub = Pub(0, ttl=1.0)
    masters = {"w": np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)}
    with Publisher(pub.board, RUN, PublisherConfig(signer=pub.signer), asynchronous=False) as p:
        assert p.publish(masters) == 0
        f = _follower(pub, pub.trust(tmp_path))
        assert f.sync() == 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # three lifetimes of LATEST, nothing published
            assert f.sync() == 0
            time.sleep(0.1)
    time.sleep(1.2)  # closed: nobody re-signs, and the pointer goes stale
    with pytest.raises(TrustError, match="expired"):
        f.sync()


def test_a_squatted_version_and_a_forged_latest_do_not_stop_the_publisher(tmp_path: Path) -> None:
    """An attacker takes the next version number and moves LATEST far ahead (own key): the
    signing publisher replaces both, and the follower goes from refusing to the honest one."""
    pub = Pub(2)
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 1
    mallory = Board(pub.store, signer=Signer(keys=(SigningKey.generate(),)))
    pub.publish(2, board=mallory)
    _put(
        pub,
        pointer_key(RUN),
        encode_latest(
            Pointer(RUN, 10**9, version_key(RUN, 10**9), "f" * 64), mallory.signer, time.time()
        ),
    )
    _refused(f, "bad_signature")
    honest = pub.publish(2)  # the honest publisher's own version 2
    assert pub.board.signer is not None
    assert pub.board.signer.signed(pub.store.get(version_key(RUN, 2)), MANIFEST_TYPE)
    assert pub.board.latest(RUN) is not None and pub.board.latest(RUN).version == 2
    assert f.sync() == 2 and f.engine.digest == honest.target


def _mutations(raw: bytes, rng: np.random.Generator, n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        b = bytearray(raw)
        op = rng.integers(0, 5)
        i = int(rng.integers(0, len(b)))
        if op == 0:
            b[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1:
            del b[i : i + int(rng.integers(1, 40))]
        elif op == 2:
            b[i:i] = bytes(rng.choice(list(b'[]{}",:\\0eE-+.\xff\xc3'), int(rng.integers(1, 8))))
        elif op == 3:
            b = b[:i]
        else:
            b[i:i] = b[int(rng.integers(0, len(b))) :][: int(rng.integers(1, 60))]
        out.append(bytes(b))
    return out


def test_mutated_envelopes_are_refused_cleanly_or_read_unchanged(tmp_path: Path) -> None:
    """3,000 mutations of a signed manifest, LATEST and root: only typed rollpatch errors,
    and nothing accepted that differs from what was signed."""
    from rollpatch.errors import RollpatchError
    from rollpatch.latest import read_latest
    from rollpatch.manifest import open_manifest
    from rollpatch.trust import verify_initial_root

    pub = Pub(2)
    trust = pub.trust()
    rng = np.random.default_rng(11)
    m_raw, p_raw = pub.store.get(version_key(RUN, 1)), pub.store.get(pointer_key(RUN))
    m_good = open_manifest(m_raw, RUN, 1, trust)
    p_good = read_latest(p_raw, RUN, trust)[0]
    r_good = verify_initial_root(pub.root)
    accepted = 0
    for raw in _mutations(m_raw, rng, 1000):
        try:
            assert open_manifest(raw, RUN, 1, trust) == m_good
            accepted += 1
        except RollpatchError:
            pass
    for raw in _mutations(p_raw, rng, 1000):
        try:
            assert read_latest(raw, RUN, trust)[0] == p_good
            accepted += 1
        except RollpatchError:
            pass
    for raw in _mutations(pub.root, rng, 1000):
        try:
            assert verify_initial_root(raw) == r_good
            accepted += 1
        except RollpatchError:
            pass
    assert accepted < 300  # the few accepted ones are whitespace-like edits outside the payload


def test_publisher_warns_when_what_it_publishes_will_not_verify(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rollpatch.publisher import Publisher, PublisherConfig

    pub = Pub(0)
    masters = {"w": np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)}
    other = Signer(keys=(SigningKey.generate(),))
    for config, words in [
        (PublisherConfig(), "UNSIGNED"),
        (PublisherConfig(signer=other), "0 of this publisher's keys"),
    ]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="rollpatch.publisher"):
            Publisher(Board(pub.store), RUN, config, asynchronous=False).close()
        assert any(words in r.getMessage() for r in caplog.records), caplog.records
    caplog.clear()
    with (
        caplog.at_level("WARNING", logger="rollpatch.publisher"),
        Publisher(pub.board, RUN, PublisherConfig(signer=pub.signer), asynchronous=False) as p,
    ):
        p.publish(masters)
    assert not caplog.records


def test_retention_on_a_signed_board_keeps_it_verifiable(tmp_path: Path) -> None:
    from rollpatch.retention import collect

    pub = Pub(6)
    collect(pub.board, RUN, keep_last=2)
    assert pub.board.versions(RUN)[-1] == 5
    f = _follower(pub, pub.trust(tmp_path))
    assert f.sync() == 5 and f.engine.digest == pub.views[5].digest()
    assert pub.board.roots() == [1]  # the root of trust is never collected
