"""Signed boards in use (issue 11): a signing publisher keeps LATEST fresh and survives a
squatted version, warns when what it publishes will not verify; retention keeps a signed
board verifiable; a follower without trust still reads it, with one warning. The signed
board: tests/trustfix.py.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from rollpatch.board import Board, pointer_key, version_key
from rollpatch.engines import ViewEngine
from rollpatch.errors import ConfigError, TrustError
from rollpatch.follower import Follower
from rollpatch.latest import encode_latest
from rollpatch.trust import MANIFEST_TYPE, Signer, SigningKey
from rollpatch.types import Pointer
from tests.trustfix import FAST, RUN, Pub, follower, put_raw, refused


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


def test_an_idle_signing_publisher_keeps_latest_fresh(tmp_path: Path) -> None:
    """The publisher re-signs LATEST between versions; a follower never sees it expire."""
    from rollpatch.publisher import Publisher, PublisherConfig

    pub = Pub(0, ttl=1.0)
    masters = {"w": np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)}
    with Publisher(pub.board, RUN, PublisherConfig(signer=pub.signer), asynchronous=False) as p:
        assert p.publish(masters) == 0
        f = follower(pub, pub.trust(tmp_path))
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
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync() == 1
    mallory = Board(pub.store, signer=Signer(keys=(SigningKey.generate(),)))
    pub.publish(2, board=mallory)
    put_raw(
        pub,
        pointer_key(RUN),
        encode_latest(
            Pointer(RUN, 10**9, version_key(RUN, 10**9), "f" * 64), mallory.signer, time.time()
        ),
    )
    refused(f, "bad_signature")
    honest = pub.publish(2)  # the honest publisher's own version 2
    assert pub.board.signer is not None
    assert pub.board.signer.signed(pub.store.get(version_key(RUN, 2)), MANIFEST_TYPE)
    assert pub.board.latest(RUN) is not None and pub.board.latest(RUN).version == 2
    assert f.sync() == 2 and f.engine.digest == honest.target


def test_a_restarted_signing_publisher_resumes_past_a_squat_and_a_forged_latest(
    tmp_path: Path,
) -> None:
    """The same attack on a publisher that restarts (as `rollpatch publish` does on every
    call): it resumes from the newest version one of its keys signed, publishes the next one
    over the squatted number and replaces LATEST. It used to refuse to start (TrustError on
    the squatted manifest; BoardError on a LATEST past the manifests), so the run was stuck."""
    import dataclasses

    from rollpatch.formats import cast_view
    from rollpatch.publisher import Publisher, PublisherConfig, reconstruct

    pub, run = Pub(0), "signed"
    rng = np.random.default_rng(1)
    masters = [{"w": rng.standard_normal((32, 64)).astype(np.float32)} for _ in range(3)]
    cfg = PublisherConfig(signer=pub.signer)
    with Publisher(pub.board, run, cfg, asynchronous=False) as p:
        assert [p.publish(m) for m in masters[:2]] == [0, 1]
    mallory = Board(pub.store, signer=Signer(keys=(SigningKey.generate(),)))
    squat = dataclasses.replace(pub.board.manifest(run, 1), version=2, parent=1)
    mallory.put_manifest(squat)
    far = Pointer(run, 10**9, version_key(run, 10**9), "f" * 64)
    put_raw(pub, pointer_key(run), encode_latest(far, mallory.signer, time.time()))
    with Publisher(pub.board, run, cfg, asynchronous=False) as p:
        assert p.publish(masters[2]) == 2
    assert pub.board.signer is not None
    assert pub.board.signer.signed(pub.store.get(version_key(run, 2)), MANIFEST_TYPE)
    trusted = Board(pub.store, trust=pub.trust(tmp_path))
    latest = trusted.latest(run)
    assert latest is not None and latest.version == 2
    assert reconstruct(trusted, run, 2).digest() == cast_view(masters[2], "bf16").digest()
    # an unsigned publisher cannot tell a forged LATEST from its own: it says what to do
    plain = Board(f"file://{tmp_path / 'plain'}")
    with Publisher(plain, run, PublisherConfig(), asynchronous=False) as p:
        p.publish(masters[0])
    plain.store.put(pointer_key(run), encode_latest(far, None, time.time()), if_absent=False)
    from rollpatch.errors import BoardError

    with pytest.raises(BoardError, match="without a manifest") as err:
        Publisher(plain, run, PublisherConfig(), asynchronous=False).publish(masters[1])
    assert "restore the run's LATEST" in str(err.value)


def test_publisher_warns_when_what_it_publishes_will_not_verify(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rollpatch.publisher import Publisher, PublisherConfig

    pub = Pub(0)
    masters = {"w": np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)}
    other = Signer(keys=(SigningKey.generate(),))
    # unsigned, or keys the board's verified root does not list: refused, not warned (every
    # version would be refused, and a signing publisher would replace the run's valid ones)
    before = {k: pub.store.get(k) for k in pub.store.list("")}
    with pytest.raises(ConfigError, match="UNSIGNED to a board with a root of trust"):
        Publisher(Board(pub.store), RUN, PublisherConfig(), asynchronous=False)
    with pytest.raises(ConfigError, match="does not list this publisher's signing keys"):
        Publisher(Board(pub.store), RUN, PublisherConfig(signer=other), asynchronous=False)
    assert {k: pub.store.get(k) for k in pub.store.list("")} == before
    caplog.clear()
    with (
        caplog.at_level("WARNING", logger="rollpatch.publisher"),
        Publisher(pub.board, RUN, PublisherConfig(signer=pub.signer), asynchronous=False) as p,
    ):
        p.publish(masters)
    assert not caplog.records
    # the board's newest root expired: everything it publishes will be refused
    from rollpatch.board import root_key
    from rollpatch.trust import Root, sign_root

    key = pub.keys[0]
    old = Root.new([key.public], version=2, expires=time.time() - 1)
    pub.store.put(root_key(2), sign_root(old, [key]))
    caplog.clear()
    with caplog.at_level("WARNING", logger="rollpatch.publisher"):
        Publisher(pub.board, RUN, PublisherConfig(signer=pub.signer), asynchronous=False).close()
    assert any("has expired" in r.getMessage() for r in caplog.records), caplog.records


def test_retention_on_a_signed_board_keeps_it_verifiable(tmp_path: Path) -> None:
    from rollpatch.retention import collect

    pub = Pub(6)
    collect(pub.board, RUN, keep_last=2)
    assert pub.board.versions(RUN)[-1] == 5
    f = follower(pub, pub.trust(tmp_path))
    assert f.sync() == 5 and f.engine.digest == pub.views[5].digest()
    assert pub.board.roots() == [1]  # the root of trust is never collected


def test_a_trust_state_path_may_be_a_string(tmp_path: Path) -> None:
    """Trust(..., state_path="...") as a str, as from a config file: the state is saved at
    the first verified LATEST (a str failed there, mid-sync, with AttributeError)."""
    from rollpatch.trust import Trust

    pub = Pub(2)
    state = tmp_path / "state.json"
    f = Follower(
        Board(pub.store), RUN, ViewEngine(), FAST, trust=Trust(pub.root, state_path=str(state))
    )
    assert f.sync() == 1 and state.is_file()


@pytest.mark.parametrize(
    ("store_ahead_s", "said"), [(7200.0, "behind"), (-7200.0, "ahead of"), (0.0, None)]
)
def test_a_publisher_says_when_its_clock_differs_from_the_stores(
    caplog: pytest.LogCaptureFixture, store_ahead_s: float, said: str | None
) -> None:
    """A signed LATEST carries this host's times: a clock 2 h behind the store's published
    LATESTs every follower refused as expired, with a hint about a dead publisher (an audit's
    LOW finding). The first signed version now compares the store's write time of its
    manifest with this host's clock and says so."""
    import dataclasses
    import uuid

    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.store import MemoryStore, ObjectInfo

    class SkewedStore(MemoryStore):  # the store's clock: store_ahead_s ahead of this host's
        def _head(self, key: str) -> ObjectInfo | None:
            info = super()._head(key)
            if info is None or info.modified is None:
                return info
            return dataclasses.replace(info, modified=info.modified + store_ahead_s)

    pub = Pub(0)
    store = SkewedStore(f"skew-{uuid.uuid4().hex}")
    board = Board(store)
    board.put_root(pub.root)
    masters = {"w": np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)}
    with (
        caplog.at_level("WARNING", logger="rollpatch.publisher"),
        Publisher(board, RUN, PublisherConfig(signer=pub.signer), asynchronous=False) as p,
    ):
        p.publish(masters)
        p.publish(masters)
    warned = [r.getMessage() for r in caplog.records if "clock" in r.getMessage()]
    if said is None:
        assert warned == []
    else:
        assert len(warned) == 1 and f"7200 s {said} the store's" in warned[0], warned


def test_copies_of_the_publishers_own_signed_documents_do_not_block_it(tmp_path: Path) -> None:
    """Audit I, H2 (session 42): anyone who can write to the store copied one of the
    publisher's own signed manifests (another version's, another run's) into the next
    version's slot, and another run's LATEST over this run's: the running publisher failed
    ("already published ... by an unreadable manifest") and a restarted one refused to start
    ("LATEST pointer names another run"). Sound signatures, wrong names: replaced."""
    from rollpatch.formats import cast_view
    from rollpatch.publisher import Publisher, PublisherConfig, reconstruct

    pub, run = Pub(0), "signed"
    rng = np.random.default_rng(2)
    masters = [{"w": rng.standard_normal((32, 64)).astype(np.float32)} for _ in range(5)]
    cfg = PublisherConfig(signer=pub.signer)
    with Publisher(pub.board, "other", cfg, asynchronous=False) as p:
        for m in masters[:3]:
            p.publish(m)
    with Publisher(pub.board, run, cfg, asynchronous=False) as p:
        assert [p.publish(m) for m in masters[:2]] == [0, 1]
        put_raw(pub, version_key(run, 2), pub.store.get(version_key(run, 0)))  # its own v0
        assert p.publish(masters[2]) == 2
        put_raw(pub, version_key(run, 3), pub.store.get(version_key("other", 2)))
        put_raw(pub, pointer_key(run), pub.store.get(pointer_key("other")))
    with Publisher(pub.board, run, cfg, asynchronous=False) as p:  # restarted
        assert p.publish(masters[3]) == 3
    trusted = Board(pub.store, trust=pub.trust(tmp_path))
    latest = trusted.latest(run)
    assert latest is not None and latest.version == 3
    assert reconstruct(trusted, run, 3).digest() == cast_view(masters[3], "bf16").digest()


def test_a_latest_ahead_of_the_publisher_signed_with_its_key_stops_it_loudly(
    tmp_path: Path,
) -> None:
    """Audit I, H1 (session 42): a run copied in from another board signed with the same key
    moved LATEST ahead; the publisher's next publish() returned its version while LATEST
    stayed on the copy, and nothing said so. Now it fails, naming the cause (one signing key
    per board: docs/trust.md)."""
    from rollpatch.errors import BoardError
    from rollpatch.publisher import Publisher, PublisherConfig

    pub = Pub(0)
    rng = np.random.default_rng(3)
    masters = [{"w": rng.standard_normal((32, 64)).astype(np.float32)} for _ in range(12)]
    cfg = PublisherConfig(signer=pub.signer)
    elsewhere = Board(f"file://{tmp_path / 'staging'}", signer=pub.signer)  # same key
    with Publisher(elsewhere, "r", cfg, asynchronous=False) as p:
        for m in masters[:8]:
            p.publish(m)
    with Publisher(pub.board, "r", cfg, asynchronous=False) as p:
        for m in masters[:3]:
            p.publish(m)
        for key in elsewhere.store.list("runs/r/"):  # v4..v7 copied in, and LATEST (v7)
            if not key.endswith("/PUBLISHER") and not any(
                key.endswith((f"{v:012d}", f"{v:012d}.json")) for v in range(4)
            ):
                put_raw(pub, key, elsewhere.store.get(key))
        with pytest.raises(BoardError, match="LATEST names version 7, ahead of this publisher's 3"):
            p.publish(masters[10])
