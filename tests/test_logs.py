"""Per-request log events held to one line per kind per period (rollpatch.logs.Throttle): a
re-sync under hundreds of requests a second logged one refusal line per request (a newcomer's
audit, session 37)."""

from __future__ import annotations

import logging

import pytest

from rollpatch.logs import Every, Throttle


def test_one_line_per_kind_per_period_and_the_count_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = [100.0]
    log = logging.getLogger("rollpatch.test.throttle")
    said = Throttle(log, every_s=10.0, clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger=log.name):
        for served in range(5):  # the same refusal, its numbers changing: one kind
            said.event("refused", f"409 behind: serving {served}, needs 9", status=409)
            clock[0] += 1
        said.event("refused", "503 no verified version loaded yet", status=503)  # another kind
        clock[0] += 10
        said.event("refused", "409 behind: serving 7, needs 9", status=409)
    lines = [r for r in caplog.records if r.name == log.name]
    assert [r.rp_event for r in lines] == ["refused"] * 3  # type: ignore[attr-defined]
    fields = [r.rp_fields for r in lines]  # type: ignore[attr-defined]
    assert [f["status"] for f in fields] == [409, 503, 409]
    assert "repeated" not in fields[0] and fields[2]["repeated"] == 4


def test_kinds_are_bounded() -> None:
    said = Throttle(logging.getLogger("rollpatch.test.throttle2"), clock=lambda: 0.0)
    for i in range(Throttle.MAX_KINDS * 3):
        said.event("refused", f"reason {'x' * (i % 50)}-{chr(65 + i % 26)}")
    assert len(said._paces._by_kind) <= Throttle.MAX_KINDS


def test_every_paces_a_line_and_counts_what_it_held_back() -> None:
    now = [100.0]
    pace = Every(60.0, clock=lambda: now[0])
    assert pace.due() and pace.said_held == 0  # the first at once
    assert not pace.due() and not pace.due() and pace.held == 2
    now[0] += 59.9
    assert not pace.due()
    now[0] += 0.1
    assert pace.due() and pace.said_held == 3 and pace.held == 0
    pace.reset()  # a new episode: at once again
    assert pace.due() and pace.said_held == 0


def test_an_event_says_its_fields_to_any_logging_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Audit I, L3 (session 42): a library user's own handler printed ``relay_retry`` alone."""
    from rollpatch.logs import event

    log = logging.getLogger("rollpatch.test_events")
    with caplog.at_level(logging.WARNING, logger="rollpatch.test_events"):
        event(log, "relay_retry", logging.WARNING, store="http://x", attempt=1, error="HTTP 503")
    (r,) = caplog.records
    assert r.getMessage() == 'relay_retry store=http://x attempt=1 error="HTTP 503"'
    assert r.rp_event == "relay_retry" and r.rp_fields["attempt"] == 1  # type: ignore[attr-defined]
