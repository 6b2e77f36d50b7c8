"""Contact with a remote engine (a newcomer's audit, session 37): a vLLM killed and restarted
under the sidecar came back holding its boot checkpoint's words, and until the next audit
noticed, the sidecar labelled its answers with the version it had verified before. Now a
request the engine does not answer (or an audit that cannot reach it) suspends the served
version: nothing is labelled, no request is proxied (503 with the reason), until the audit
re-checks the engine (its identity: a restarted one is found so and re-synced) or a verified
commit lands."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rollpatch.engines import ViewEngine
from rollpatch.engines.restarts import RESTARTED
from rollpatch.engines.staged import AuditReport
from rollpatch.errors import EngineError, EngineUnreachableError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.follower.commit import CommitGate
from rollpatch.publisher import Publisher
from tests.conftest import masters


class Remote(ViewEngine):
    """A stand-in remote engine: ``down`` makes every call unreachable; ``restarted`` makes
    the next audit find another boot identity (the adapter then holds no version)."""

    name = "remote"
    remote = True

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.restarted = False

    def audit(self, budget_bytes: int) -> AuditReport:
        if self.down:
            raise EngineUnreachableError("remote is not reachable: connection refused")
        if self.restarted:
            self._version = None  # what the vLLM/SGLang adapters do on a new boot identity
            return AuditReport(1, 8, (RESTARTED,), False)
        return AuditReport(1, 8, (), False)


@pytest.fixture
def follower(tmp_path: Any) -> Follower:
    board = f"file://{tmp_path / 'board'}"
    with Publisher(board, "r", asynchronous=False) as pub:
        pub.publish(masters(1))
        pub.publish(masters(1, step=1e-3))
    eng = Remote()
    f = Follower(board, "r", eng, FollowerConfig(audit_bytes_per_s=1e6, audit_period_s=60.0))
    assert f.sync() == 1 and f.version == 1
    return f


def test_an_unanswered_request_suspends_the_version_until_the_audit_answers(
    follower: Follower, caplog: pytest.LogCaptureFixture
) -> None:
    gate, auditor, eng = follower.gate, follower.auditor, follower.engine
    assert auditor is not None and isinstance(eng, Remote)
    with caplog.at_level(logging.INFO, logger="rollpatch.follower"):
        follower.engine_unreachable("a request could not reach it: connection refused")
        assert follower.version is None and gate.served() is None
        with gate.admit(1.0) as slot:  # a request admitted now is labelled with nothing
            assert slot.start is None
        eng.down = True
        with pytest.raises(EngineUnreachableError):
            auditor.step()
        gate.contact(False)  # what the audit loop says then
        assert gate.suspect is not None and follower.version is None
        eng.down = False
        assert auditor.step() is not None  # answered: the same engine, its words checked
        assert gate.suspect is None and follower.version == 1 and gate.served() == 1
    said = caplog.text
    assert "serving nothing until it is re-checked" in said and "re-checked; serving" in said


def test_a_restarted_engine_found_by_the_recheck_is_re_synced(follower: Follower) -> None:
    eng = follower.engine
    assert isinstance(eng, Remote) and follower.auditor is not None
    follower.engine_unreachable("a request could not reach it")
    eng.restarted = True
    follower.auditor.step()  # the identity check finds the restart: no version at all
    assert eng.version is None and follower.version is None
    eng.restarted = False
    assert follower.sync() == 1 and follower.version == 1  # re-synced, verified
    assert follower.gate.suspect is None


def test_a_verified_commit_ends_the_suspicion_and_audits_off_the_heartbeat_does(
    tmp_path: Any,
) -> None:
    """With audits off, the follower still calls the engine every period (a heartbeat that
    hashes nothing: the test below), so a lost contact is re-checked by it, its identity
    included (before session 40 nothing could re-check it, and the version was not
    suspended at all)."""
    gate = CommitGate(Remote(), "pause")
    gate.suspend("a request could not reach it")
    gate.run(lambda: None)
    assert gate.suspect is None
    board = f"file://{tmp_path / 'b'}"
    with Publisher(board, "r", asynchronous=False) as pub:
        pub.publish(masters(1))
    f = Follower(board, "r", Remote(), FollowerConfig(audit_bytes_per_s=None))
    assert f.sync() == 0
    f.engine_unreachable("x")
    assert f.version is None and f.gate.suspect is not None
    assert f.auditor.budget == 0 and f.auditor.step() is not None  # the heartbeat answers
    assert f.version == 0 and f.gate.suspect is None
    g = Follower(board, "r", ViewEngine())  # in this process: it cannot restart on its own
    assert g.sync() == 0 and g.auditor is not None
    g.engine_unreachable("x")
    assert g.version == 0 and g.gate.suspect is None


def test_the_audit_loop_suspends_on_an_unreachable_engine_only() -> None:
    from rollpatch.follower.audit import Auditor

    said: list[bool] = []
    eng = Remote()
    eng._version, eng._digest = 1, "d"  # type: ignore[attr-defined]
    auditor = Auditor(
        eng, rate_bytes_per_s=8, period_s=0.01, on_mismatch=lambda r: None, on_contact=said.append
    )
    eng.down = True
    auditor.start()
    try:
        import time

        deadline = time.monotonic() + 10
        while False not in said:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        auditor.stop()
    said.clear()

    def busy(budget: int) -> AuditReport:
        raise EngineError("remote is busy")

    eng.down = False
    eng.audit = busy  # type: ignore[method-assign]
    auditor.start()
    try:
        time.sleep(0.2)
    finally:
        auditor.stop()
    assert said == []  # another failure is not lost contact


class Recording(Remote):
    """Records each audit's budget; ``taken`` makes the next call find another adapter
    holding the engine (what the vLLM/SGLang adapters then do: no version)."""

    def __init__(self) -> None:
        super().__init__()
        self.budgets: list[int] = []
        self.taken = False

    def audit(self, budget_bytes: int) -> AuditReport:
        self.budgets.append(budget_bytes)
        if self.taken:
            self._version = None
            raise EngineError(
                "another rollpatch adapter took this engine over",
                taken_over=True,
                other_adapter=True,
            )
        return AuditReport(0, 0, (), False)


def test_with_audits_off_the_follower_still_calls_the_engine_every_period(tmp_path: Any) -> None:
    """Audits off (`--audit-bytes-per-s none`): an idle adapter made no call between commits,
    so a second sidecar took the engine over once the ownership lease ran out, and the first
    went on labelling the other's weights (an audit, session 40, on SGLang). Now the follower
    calls the engine every period with a budget of 0 (nothing hashed): the call renews the
    adapter's hold, and a takeover found by it voids the version."""
    import time

    from rollpatch.engines.staged import AuditCursor as Cursor

    assert Cursor().take(["a", "b"], lambda n: 8, 0) == ([], False)  # nothing hashed at 0
    assert Cursor().take(["a", "b"], lambda n: 8, 1) == (["a"], False)  # one at least, else
    board = f"file://{tmp_path / 'board'}"
    with Publisher(board, "r", asynchronous=False) as pub:
        pub.publish(masters(1))
    eng = Recording()
    f = Follower(board, "r", eng, FollowerConfig(audit_bytes_per_s=None, audit_period_s=0.02))
    assert f.sync() == 0 and f.version == 0
    f.start()
    try:
        deadline = time.monotonic() + 30
        while len(eng.budgets) < 3:
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.01)
        assert set(eng.budgets) == {0}
        eng.taken = True
        while f.version is not None:
            assert time.monotonic() < deadline, "the takeover was never noticed"
            time.sleep(0.01)
    finally:
        f.stop()


def test_an_engine_another_adapter_took_over_is_said_so(tmp_path: Any) -> None:
    """A sidecar whose engine another sidecar took over said "contact with the engine was
    lost" (a re-check, session 40): the audit's refusal names the takeover now."""
    import time

    board = f"file://{tmp_path / 'board'}"
    with Publisher(board, "r", asynchronous=False) as pub:
        pub.publish(masters(1))
    eng = Recording()
    f = Follower(board, "r", eng, FollowerConfig(audit_bytes_per_s=None, audit_period_s=0.02))
    assert f.sync() == 0
    eng.taken = True
    f.start()
    try:
        deadline = time.monotonic() + 30
        while "another rollpatch adapter" not in (f.gate.suspect or ""):
            assert time.monotonic() < deadline, f.gate.suspect
            time.sleep(0.01)
        assert f.version is None
    finally:
        f.stop()
