"""Signed boards under a root of trust (issue 11): every attack on signing and LATEST.

Each test names the attack it replays; the follower must refuse it with a TrustError whose
``reason`` names it, keep its last good version, and take the next honest version. The
signed board: tests/trustfix.py; the root itself (rotation, thresholds, expiry, state):
test_trust_root.py; signing publishers, retention and followers without trust:
test_trust_publishing.py.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import pytest

from rollpatch.board import Board, pointer_key, version_key
from rollpatch.errors import ManifestError, TrustError
from rollpatch.follower import FollowerState
from rollpatch.latest import encode_latest
from rollpatch.trust import LATEST_TYPE, MANIFEST_TYPE, Signer, SigningKey, load_envelope
from rollpatch.types import Pointer
from tests.trustfix import RUN, Pub, follower, put_raw, refused


def test_signed_board_is_followed_bit_exactly(tmp_path: Path) -> None:
    pub = Pub(4)
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync() == 3
    assert f.engine.digest == pub.views[3].digest()
    env = load_envelope(pub.store.get(version_key(RUN, 3)), expect=MANIFEST_TYPE, max_bytes=1 << 20)
    assert json.loads(env.payload)["target"] == pub.views[3].digest()


def test_forged_manifest_signed_by_an_outside_key_is_refused(tmp_path: Path) -> None:
    """Anyone who can write to the store: a new version signed with their own key."""
    pub = Pub(2)
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync() == 1
    mallory = Board(pub.store, signer=Signer(keys=(SigningKey.generate(),)))
    pub.publish(2, board=mallory)
    fetched = f.status().objects_fetched
    err = refused(f, "bad_signature")  # its LATEST
    assert "0 valid signature" in str(err) and err.context["what_doc"] == "LATEST"
    err = refused(f, "bad_signature", 2)  # its manifest, asked for by number
    assert err.context["what_doc"] == "manifest"
    assert f.engine.digest == pub.views[1].digest()
    assert f.status().objects_fetched == fetched  # nothing of the forged version was fetched


def test_unsigned_manifest_and_latest_on_a_signed_run_are_refused(tmp_path: Path) -> None:
    """A follower without a key accepted unsigned manifests; LATEST was never signed."""
    pub = Pub(2)
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync() == 1
    pub.publish(2, board=Board(pub.store))  # a bare manifest and a bare LATEST
    assert "LATEST is not signed" in str(refused(f, "unsigned"))
    put_raw(
        pub,
        pointer_key(RUN),
        encode_latest(
            Pointer(RUN, 2, version_key(RUN, 2), pub.views[2].digest()), pub.signer, time.time()
        ),
    )
    err = refused(f, "unsigned")
    assert "manifest is not signed" in str(err)
    assert f.engine.digest == pub.views[1].digest()


def test_tampered_payload_under_a_valid_signature_is_refused(tmp_path: Path) -> None:
    """Mix-and-match: swap the target digest / an object entry, keep the signatures."""
    pub = Pub(3)
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync(1) == 1
    doc = json.loads(pub.store.get(version_key(RUN, 2)))
    payload = json.loads(base64.b64decode(doc["payload"]))
    payload["patches"][0]["b3"] = payload["patches"][0]["b3"][::-1]
    doc["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    put_raw(pub, version_key(RUN, 2), json.dumps(doc).encode())
    refused(f, "bad_signature", 2)


def test_manifest_moved_to_another_versions_key_is_refused(tmp_path: Path) -> None:
    """A validly signed manifest of version 1 stored as version 2 (run/version are bound)."""
    pub = Pub(3)
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync(1) == 1
    put_raw(pub, version_key(RUN, 2), pub.store.get(version_key(RUN, 1)))
    with pytest.raises(ManifestError, match="names another version"):
        f.sync(2)
    assert f.version == 1
    from rollpatch.board import Board

    put_raw(pub, version_key("other", 1), pub.store.get(version_key(RUN, 1)))
    with pytest.raises(ManifestError, match="names another run"):  # it said "version"
        Board(pub.store).manifest("other", 1)  # (an audit, session 42)


def test_envelope_of_another_type_is_refused(tmp_path: Path) -> None:
    """A signed manifest served as LATEST: the payload type is signed too."""
    pub = Pub(2)
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync() == 1
    put_raw(pub, pointer_key(RUN), pub.store.get(version_key(RUN, 1)))
    refused(f, "bad_signature")


def test_latest_pointed_back_is_a_rollback_also_after_a_restart(tmp_path: Path) -> None:
    """Pointing LATEST back to version 1 (a validly signed old pointer, replayed)."""
    pub = Pub(2)
    old = pub.store.get(pointer_key(RUN))
    pub.publish(2)
    pub.publish(3)
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync() == 3
    put_raw(pub, pointer_key(RUN), old)
    err = refused(f, "rollback")
    assert err.context["verified"] == 3 and f.engine.digest == pub.views[3].digest()
    # a restarted follower (fresh engine, same state file) refuses it too
    again = follower(pub, pub.trust(tmp_path))
    with pytest.raises(TrustError, match="rollback"):
        again.sync()
    assert again.engine.version is None
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["latest"] == {RUN: 3}


def test_a_disk_that_refuses_the_state_stops_no_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The state file's disk is full (or read only): before, saving it raised OSError out of
    the LATEST check, so each new version failed its first sync (with no clear error). Now
    the version is taken, the failure is a WARNING, and this process still refuses a
    rollback (the state is kept in memory); the next save that works writes it all."""
    import errno
    import logging

    from rollpatch.trust.state import TrustState

    pub = Pub(2)
    old = pub.store.get(pointer_key(RUN))
    pub.publish(2)
    trust = pub.trust(tmp_path)
    f = follower(pub, trust)
    assert f.sync() == 2
    save = TrustState.save

    def full(self: TrustState, path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TrustState, "save", full)
    pub.publish(3)
    with caplog.at_level(logging.WARNING, "rollpatch.trust"):
        assert f.sync() == 3  # taken, though the state could not be saved
    assert trust.save_errors == 1
    said = [r for r in caplog.records if getattr(r, "rp_event", None) == "trust_state_unsaved"]
    assert len(said) == 1 and "No space left" in said[0].rp_fields["error"]  # type: ignore[attr-defined]
    assert json.loads((tmp_path / "state.json").read_text())["latest"] == {RUN: 2}
    put_raw(pub, pointer_key(RUN), old)
    refused(f, "rollback")  # refused from memory
    monkeypatch.setattr(TrustState, "save", save)
    pub.publish(4)
    assert f.sync() == 4
    assert json.loads((tmp_path / "state.json").read_text())["latest"] == {RUN: 4}


def test_frozen_latest_expires(tmp_path: Path) -> None:
    """Nothing detected a frozen LATEST: a signed pointer replayed past its expiry."""
    pub = Pub(2, ttl=60.0)
    now = [time.time()]
    f = follower(pub, pub.trust(tmp_path, clock=lambda: now[0]))
    assert f.sync() == 1
    now[0] += 120  # the publisher stopped re-signing (or an attacker froze the pointer)
    err = refused(f, "expired")
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
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync() == 0
    put_raw(pub, pointer_key(RUN), raw)
    with pytest.raises(ManifestError):
        f.sync()
    assert f.version == 0


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
