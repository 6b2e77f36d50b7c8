"""Relays with a trust root verify before they cache (issue 11), and the trust CLI.

Relays are real uvicorn servers on loopback, read through the ``http://`` store client, as
followers read them; boards are ``memory://`` stores written by a signing :class:`Board`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollpatch.board import Board, pointer_key, root_key, version_key
from rollpatch.cli import main
from rollpatch.engines import ViewEngine
from rollpatch.errors import ManifestError, TrustError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.relay.verify import StalePointer
from rollpatch.store import Store, open_store
from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root
from tests.conftest import make_manifest, signing_world
from tests.trustfix import RUN, Pub

FAST = FollowerConfig(poll_s=0.01, backoff_s=0.001, retries=1, timeout_s=10.0)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    servers: list[RelayServer] = []

    def start(upstream: Store, cache: str = "cache", trust: Trust | None = None) -> RelayServer:
        server = RelayServer(
            upstream,
            RelayConfig(cache_dir=tmp_path / cache, pointer_ttl=0, list_ttl=0),
            trust=trust,
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def client(server: RelayServer) -> Store:
    return open_store(server.url, retries=0, timeout=10)


def _forge(pub: Pub, n: int) -> bytes:
    """Version ``n`` published by an attacker who can write to the store (own key)."""
    pub.publish(n, board=Board(pub.store, signer=Signer(keys=(SigningKey.generate(),))))
    return pub.store.get(version_key(RUN, n))


def test_relay_refuses_forged_manifests_and_latest_before_caching(serve, tmp_path: Path) -> None:
    pub = Pub(2)
    relay = serve(pub.store, trust=pub.trust(tmp_path))
    c = client(relay)
    assert c.get(version_key(RUN, 1)) == pub.store.get(version_key(RUN, 1))
    _forge(pub, 2)
    for key in (version_key(RUN, 2), pointer_key(RUN)):
        with pytest.raises(TrustError, match="upstream") as refusal:  # 502, with why and
            c.get(key)  # the reason (before session 42 a StoreError with none: audit I)
        assert refusal.value.reason == "bad_signature"
        with httpx.Client() as h:
            r = h.get(f"{relay.url}/v1/objects/{key}")
            assert r.status_code == 502 and "valid signature" in r.json()["error"]["message"]
    assert version_key(RUN, 2) not in relay.relay.cache
    m = relay.relay.metrics
    assert m.value("rollpatch_relay_refused_total", reason="trust_bad_signature") == 4
    # the upstream copy is repaired (the honest version 2 replaces the forgery): served
    good = Pub.manifest_for(pub, 2)
    pub.store.delete(version_key(RUN, 2))
    pub.board.put_manifest(good)
    pub.board.advance(RUN, 2, refresh=True)
    assert c.get(version_key(RUN, 2)) == pub.store.get(version_key(RUN, 2))
    # a follower reading through the relay (with its own trust) reaches version 2
    f = Follower(Board(c), RUN, ViewEngine(), FAST, trust=pub.trust(tmp_path / "f"))
    assert f.sync() == 2 and f.engine.digest == pub.views[2].digest()


def test_relay_drops_a_forged_manifest_it_cached_without_trust(serve, tmp_path: Path) -> None:
    """A relay kept a forged manifest after the upstream copy was repaired."""
    pub = Pub(2)
    forged = _forge(pub, 2)
    first = serve(pub.store, cache="warm")  # no trust root: it caches what parses
    assert client(first).get(version_key(RUN, 2)) == forged
    first.stop()
    pub.store.delete(version_key(RUN, 2))  # upstream repaired
    honest = pub.manifest_for(2)
    pub.board.put_manifest(honest)
    pub.board.advance(RUN, 2, refresh=True)
    second = serve(pub.store, cache="warm", trust=pub.trust(tmp_path))
    got = client(second).get(version_key(RUN, 2))
    assert got == pub.store.get(version_key(RUN, 2)) and got != forged
    assert (
        second.relay.metrics.value("rollpatch_relay_refused_total", reason="trust_bad_signature")
        == 1
    )


def test_relay_refuses_rollback_and_expired_latest(serve, tmp_path: Path) -> None:
    pub = Pub(2, ttl=60.0)
    old = pub.store.get(pointer_key(RUN))
    pub.publish(2)
    now = [time.time()]
    relay = serve(pub.store, trust=pub.trust(tmp_path, clock=lambda: now[0]))
    c = client(relay)
    c.get(pointer_key(RUN))
    pub.store.put(pointer_key(RUN), old, if_absent=False)  # pointed back to version 1
    with pytest.raises(TrustError, match="rollback"):
        c.get(pointer_key(RUN))
    assert relay.relay.metrics.value("rollpatch_relay_refused_total", reason="trust_rollback") == 1
    pub.board.advance(RUN, 2, refresh=True)
    c.get(pointer_key(RUN))
    now[0] += 3600  # nobody re-signs: frozen
    with pytest.raises(TrustError, match="LATEST has expired") as err:
        c.get(pointer_key(RUN))
    assert err.value.hint is not None and "re-signs LATEST" in err.value.hint
    assert relay.relay.metrics.value("rollpatch_relay_refused_total", reason="trust_expired") == 1
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["latest"] == {RUN: 2}


def test_an_overtaken_latest_is_stale_not_a_rollback(serve, tmp_path: Path) -> None:
    """Two reads of LATEST cross (the older answer arrives after a newer one was verified):
    the older is not served and counted stale, not refused; the same bytes read after the
    newer one was verified are a rollback and refused."""
    pub = Pub(2, ttl=60.0)
    old = pub.store.get(pointer_key(RUN))
    pub.publish(2)
    relay = serve(pub.store, trust=pub.trust(tmp_path))
    verifier = relay.relay.verifier
    sent = time.monotonic()  # the older read was sent before v2 was verified
    assert client(relay).get(pointer_key(RUN)) == pub.store.get(pointer_key(RUN))
    with pytest.raises(StalePointer):
        verifier.check_pointer(pointer_key(RUN), old, started=sent)
    metrics = relay.relay.metrics
    assert metrics.value("rollpatch_relay_stale_pointers_total") == 1
    assert metrics.value("rollpatch_relay_refused_total", reason="trust_rollback") == 0
    with pytest.raises(ManifestError) as e:  # asked after v2 was verified: a rollback
        verifier.check_pointer(pointer_key(RUN), old, started=time.monotonic())
    assert not isinstance(e.value, StalePointer)
    assert metrics.value("rollpatch_relay_refused_total", reason="trust_rollback") == 1


def test_a_read_overtaken_while_the_newer_is_being_verified_is_stale(
    serve, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newer LATEST's check has passed the trust root (which now calls the older one a
    rollback) but not yet recorded when it was verified, when the older answer of a read
    sent before it arrives: that read is stale, not a refused rollback (pointer checks are
    one at a time)."""
    from rollpatch.relay import verify

    pub = Pub(2, ttl=60.0)
    old = pub.store.get(pointer_key(RUN))
    pub.publish(2)
    new = pub.store.get(pointer_key(RUN))
    relay = serve(pub.store, trust=pub.trust(tmp_path))
    verifier = relay.relay.verifier
    inside = threading.Event()
    real = verify.read_latest

    def slow(data: bytes, *a: object, **k: object) -> object:
        out = real(data, *a, **k)  # type: ignore[arg-type]
        if data == new:
            inside.set()
            time.sleep(0.3)  # the trust root already holds v2; its time is not recorded yet
        return out

    monkeypatch.setattr(verify, "read_latest", slow)
    sent = time.monotonic()  # the older read was sent before v2's check began
    newer = threading.Thread(target=verifier.check_pointer, args=(pointer_key(RUN), new))
    newer.start()
    assert inside.wait(10)
    with pytest.raises(StalePointer):
        verifier.check_pointer(pointer_key(RUN), old, started=sent)
    newer.join()
    metrics = relay.relay.metrics
    assert metrics.value("rollpatch_relay_stale_pointers_total") == 1
    assert metrics.value("rollpatch_relay_refused_total", reason="trust_rollback") == 0


def test_relay_serves_only_roots_that_chain(serve, tmp_path: Path) -> None:
    pub = Pub(1)
    relay = serve(pub.store, trust=pub.trust(tmp_path))
    c = client(relay)
    assert c.get(root_key(1)) == pub.root
    new = SigningKey.generate()
    good = sign_root(Root.new([new.public], version=2), [pub.keys[0], new])
    pub.store.put(root_key(2), good)
    assert c.get(root_key(2)) == good and root_key(2) in relay.relay.cache
    mallory = SigningKey.generate()
    pub.store.put(root_key(3), sign_root(Root.new([mallory.public], version=3), [mallory]))
    with pytest.raises(TrustError, match="root 3 is not signed"):
        c.get(root_key(3))
    assert root_key(3) not in relay.relay.cache


# -- the command line ---------------------------------------------------------------------------


def _keygen(tmp: Path, name: str) -> tuple[Path, Path]:
    assert main(["keygen", "-o", str(tmp / name)]) == 0
    return tmp / f"{name}.key", tmp / f"{name}.pub"


def test_cli_keygen_root_publish_pull_and_a_forgery(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world = signing_world(tmp_path)
    board, key, pub, root, ckpt = world.board, world.key, world.pub, world.root, world.ckpt
    assert (key.stat().st_mode & 0o777) == 0o600 and pub.read_text().startswith("ed25519:")
    assert main(["keygen", "-o", str(tmp_path / "trainer")]) == 2  # never overwrites
    assert (
        main(["publish", str(ckpt), "--board", board, "--run", "r1", "--signing-key", str(key)])
        == 0
    )
    state = tmp_path / "state.json"
    pull = [
        "pull",
        "--board",
        board,
        "--run",
        "r1",
        "--trust",
        str(root),
        "--trust-state",
        str(state),
    ]
    assert main([*pull, "-o", str(tmp_path / "a.safetensors")]) == 0
    capsys.readouterr()
    # an attacker with write access to the board publishes version 1 with their own key
    evil, _ = _keygen(tmp_path, "evil")
    assert (
        main(["publish", str(ckpt), "--board", board, "--run", "r1", "--signing-key", str(evil)])
        == 2
    )  # the publisher resumes on its keys only
    capsys.readouterr()
    b = Board(board)
    m = b.manifest("r1", 0)
    Board(b.store, signer=Signer.from_files([evil])).put_manifest(
        make_manifest(
            "r1",
            1,
            fmt=m.format,
            target=m.target,
            view_bytes=m.view_bytes,
            created=m.created,
            publisher="evil",
            keyframes=m.keyframes,
        )
    )
    Board(b.store, signer=Signer.from_files([evil])).advance("r1", 1)
    capsys.readouterr()  # the attacker's own board logs a warning: not pull's output
    code = main([*pull, "-o", str(tmp_path / "b.safetensors")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not (tmp_path / "b.safetensors").exists()
    assert len(err) == 1 and err[0].startswith("rollpatch: error:") and "bad_signature" in err[0]
    # status shows which manifests are stored signed
    assert main(["status", "--board", board, "--run", "r1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["runs"][0]["versions"]
    assert [r["signed"] for r in rows] == [True, True]


def test_cli_root_rotation_needs_the_previous_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    board = f"file://{tmp_path / 'board'}"
    k1, p1 = _keygen(tmp_path, "one")
    k2, p2 = _keygen(tmp_path, "two")
    assert main(["root", "--board", board, "--key", str(p1), "--sign", str(k1)]) == 0
    capsys.readouterr()
    assert main(["root", "--board", board, "--key", str(p2), "--sign", str(k2)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "previous root" in err[0]
    assert (
        main(["root", "--board", board, "--key", str(p2), "--sign", str(k1), "--sign", str(k2)])
        == 0
    )
    assert Board(board).roots() == [1, 2]
    assert (
        main(
            [
                "root",
                "--key",
                str(p1),
                "--threshold",
                "2",
                "--sign",
                str(k1),
                "-o",
                str(tmp_path / "r.json"),
            ]
        )
        == 2
    )  # threshold above the keys


@pytest.mark.parametrize("cmd", ["pull", "sidecar", "relay"])
def test_cli_bad_trust_root_exits_2_with_one_line(
    tmp_path: Path, cmd: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "root.json"
    bad.write_text('{"payload": "", "payloadType": "x", "signatures": []}')
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # past the CLI's model preflight
    (tmp_path / "board").mkdir()  # past the board preflight (an empty board)
    board = str(tmp_path / "board")
    args = {
        "pull": ["pull", "--board", board, "--run", "r", "-o", str(tmp_path / "o")],
        "sidecar": [
            "sidecar",
            "--board",
            board,
            "--run",
            "r",
            "--port",
            "0",
            "--model",
            str(tmp_path / "model"),
        ],
        "relay": ["relay", "--board", board, "--cache", str(tmp_path / "c"), "--port", "0"],
    }[cmd]
    assert main([*args, "--trust", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trust root" in err[0], err
    assert main([*args, "--trust", str(tmp_path / "missing.json")]) == 2


def test_cli_relay_process_with_trust_refuses_a_forgery(tmp_path: Path) -> None:
    """``rollpatch relay --trust``: a real process, a follower reading through it."""
    pub = Pub(2)
    root = tmp_path / "root.json"
    root.write_bytes(pub.root)
    board = f"file://{tmp_path / 'board'}"
    files = Board(board)
    for k in pub.store.list(""):
        files.store.put(k, pub.store.get(k))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollpatch",
            "relay",
            "--board",
            board,
            "--cache",
            str(tmp_path / "cache"),
            "--port",
            "0",
            "--pointer-ttl",
            "0",
            "--list-ttl",
            "0",
            "--trust",
            str(root),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        url = line.split(" at ")[1].split(" ")[0]
        c = open_store(url, retries=0, timeout=10)
        f = Follower(Board(c), RUN, ViewEngine(), FAST, trust=pub.trust(tmp_path / "f"))
        assert f.sync() == 1
        mallory = Board(files.store, signer=Signer(keys=(SigningKey.generate(),)))
        pub.store = files.store  # type: ignore[assignment]
        pub.board = Board(files.store, signer=pub.signer)
        pub.publish(2, board=mallory)
        with pytest.raises(TrustError, match="valid signature"):  # the relay's 502, with why
            f.sync(2)
        assert f.version == 1
        with pytest.raises(TrustError, match="upstream manifest refused") as refusal:
            c.get(version_key(RUN, 2))
        assert refusal.value.reason == "bad_signature"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""


def test_a_refusal_keeps_its_reason_through_a_chain_of_relays(serve, tmp_path: Path) -> None:
    """Audit I, M4 (session 42): behind relay B reading relay A, A's trust refusals reached
    followers as ``StoreError: relay refused: relay refused: ...`` with no reason, and B's
    ``refused_total`` stayed 0. Now a TrustError with its reason, counted by both relays."""
    pub = Pub(2)
    a = serve(pub.store, trust=pub.trust(tmp_path / "a"))
    b = serve(client(a), cache="cache-b", trust=pub.trust(tmp_path / "b"))
    f = Follower(Board(client(b)), RUN, ViewEngine(), FAST, trust=pub.trust(tmp_path / "f"))
    assert f.sync() == 1
    _forge(pub, 2)
    with pytest.raises(TrustError) as refusal:
        f.sync()
    assert refusal.value.reason == "bad_signature"
    assert "relay refused" not in refusal.value.message
    st = f.status()
    assert st.error_type == "TrustError" and f.version == 1
    for relay in (a, b):
        counted = relay.relay.metrics.value(
            "rollpatch_relay_refused_total", reason="trust_bad_signature"
        )
        assert counted >= 1, relay.url
