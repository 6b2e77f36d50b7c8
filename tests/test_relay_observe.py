"""What the relay tells its operators (docs/relay.md, "Metrics"): bounded labels, upstream
failures counted and said once per outage (``upstream_down`` / ``upstream_up``) even when no
client is refused, the age of LATEST as the watch last heard it, and a metrics table in the
docs that names every series and label value the relay exports.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import httpx
import pytest

from rollpatch.board import Board
from rollpatch.errors import (
    NotFoundError,
    ObjectIntegrityError,
    TooLargeError,
    TransientStoreError,
    TrustError,
)
from rollpatch.layout import pointer_key
from rollpatch.relay import Metrics, unannounced, upstream
from rollpatch.relay import metrics as relay_metrics
from rollpatch.relay.upstream import UpstreamCalls, failure_reason
from rollpatch.types import ObjectRef
from tests.conftest import until
from tests.relayfix import RUN, Counting, board, client, objects, serve

_FIXTURES = (board, objects, serve)  # used by name
DOCS = Path(__file__).resolve().parents[1] / "docs" / "relay.md"
KEY = pointer_key(RUN)


def _said(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "rp_event", None) == name]


def _methods(text: str) -> set[str]:
    return set(re.findall(r'^rollpatch_relay_requests_total\{method="([^"]*)"', text, re.MULTILINE))


def test_made_up_methods_add_no_series(board: Board, objects: list[ObjectRef], serve) -> None:
    """A client's method becomes a label only when the relay serves it (GET, HEAD): 40
    made-up methods are all ``other``, so they add one series, not 40."""
    relay = serve(board.store)
    url = f"{relay.url}/v1/objects/{objects[0].key}"
    with httpx.Client(timeout=10) as h:
        assert h.get(url).status_code == 200
        assert h.head(url).status_code == 200
        for i in range(40):
            assert h.request(f"MADEUP{i}", url).status_code >= 400
        text = h.get(f"{relay.url}/metrics").text
    assert _methods(text) == {"GET", "HEAD", "other"}
    series = [x for x in text.splitlines() if x.startswith("rollpatch_relay_requests_total{")]
    assert len(series) <= 4, series  # GET 200 (twice: metrics), HEAD 200, other 405


def test_failure_reasons_are_a_fixed_set() -> None:
    assert failure_reason(TransientStoreError("down")) == "transient"
    assert failure_reason(TimeoutError()) == "transient"
    assert failure_reason(TooLargeError("big")) == "too_large"
    assert failure_reason(ObjectIntegrityError("bad")) == "refused"
    assert failure_reason(TrustError("bad", reason="unsigned")) == "refused"
    assert failure_reason(PermissionError("denied")) == "other"
    assert failure_reason(NotFoundError("absent")) is None  # an answer, not a failure
    assert unannounced.reason_of(ObjectIntegrityError("bad")) == "corrupt"
    assert unannounced.reason_of(NotFoundError("absent")) == "missing"
    assert unannounced.reason_of(TimeoutError()) == "timeout"
    assert unannounced.reason_of(KeyError("?")) == "other"


def test_an_outage_is_said_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    """Failures are counted each; the log says the state changes only: one ``upstream_down``
    (op, key, error) and one ``upstream_up`` (seconds, failed). Answers that are not
    failures (a key absent upstream) end an outage too."""
    now = [100.0]
    metrics = Metrics()
    calls = UpstreamCalls("memory://up", metrics, clock=lambda: now[0])

    def offline(key: str) -> bytes:
        raise TransientStoreError("upstream is offline (test)", key=key)

    def absent(key: str) -> bytes:
        raise NotFoundError("absent", key=key)

    caplog.set_level(logging.INFO, logger="rollpatch.relay")
    for i in range(5):
        with pytest.raises(TransientStoreError):
            calls.call("get", offline, f"k{i}")
    assert calls.down
    now[0] += 7.5
    with pytest.raises(NotFoundError):
        calls.call("head", absent, "k")
    assert not calls.down
    assert calls.call("list", lambda k: [k], "p") == ["p"]
    value = metrics.value
    assert value("rollpatch_relay_upstream_errors_total", op="get", reason="transient") == 5
    assert metrics.total("rollpatch_relay_upstream_errors_total") == 5  # not found: no error
    assert value("rollpatch_relay_upstream_requests_total", op="get") == 5
    [down] = _said(caplog, "upstream_down")
    assert down.levelno == logging.WARNING
    assert down.rp_fields["op"] == "get" and down.rp_fields["key"] == "k0"  # type: ignore[attr-defined]
    assert "TransientStoreError" in down.rp_fields["error"]  # type: ignore[attr-defined]
    [up] = _said(caplog, "upstream_up")
    assert up.levelno == logging.INFO
    assert up.rp_fields["seconds"] == 7.5 and up.rp_fields["failed"] == 5  # type: ignore[attr-defined]
    # an upstream that flaps (fails, answers, fails, ...) within the minute: no line per flip;
    # the next outage said, after the minute, counts those held back
    for _ in range(10):
        now[0] += 1.0
        with pytest.raises(TransientStoreError):
            calls.call("get", offline, "k")
        calls.call("list", lambda k: [k], "p")
    assert len(_said(caplog, "upstream_down")) == 1 and len(_said(caplog, "upstream_up")) == 1
    now[0] += 60.0
    with pytest.raises(TransientStoreError):
        calls.call("get", offline, "k")
    later = _said(caplog, "upstream_down")
    assert len(later) == 2 and later[1].rp_fields["outages_held"] == 10  # type: ignore[attr-defined]


def test_an_upstream_outage_is_counted_and_logged_through_the_server(
    board: Board, objects: list[ObjectRef], serve, caplog: pytest.LogCaptureFixture
) -> None:
    """Reads through a relay whose store goes offline: the counter moves per failed call,
    exactly one ``upstream_down``; back online, one ``upstream_up`` naming the failures."""
    store = Counting(board.store)
    relay = serve(store)
    c = client(relay)
    caplog.set_level(logging.INFO, logger="rollpatch.relay")
    store.offline = True
    for ref in objects[:4]:
        with pytest.raises(TransientStoreError):
            c.get(ref.key)
    metrics = relay.relay.metrics
    # objects no manifest named yet: each miss starts with a HEAD for its size (session 43)
    failed = metrics.value("rollpatch_relay_upstream_errors_total", op="head", reason="transient")
    assert failed == 4 and metrics.total("rollpatch_relay_upstream_errors_total") == 4
    [down] = _said(caplog, "upstream_down")
    assert down.rp_fields["key"] == objects[0].key  # type: ignore[attr-defined]
    assert not _said(caplog, "upstream_up")
    store.offline = False
    assert c.get(objects[0].key) == board.store.get(objects[0].key)
    c.get(objects[1].key)
    [up] = _said(caplog, "upstream_up")
    assert up.rp_fields["failed"] == 4  # type: ignore[attr-defined]
    assert len(_said(caplog, "upstream_down")) == 1
    rendered = metrics.render()
    line = 'rollpatch_relay_upstream_errors_total{op="head",reason="transient"} 4'
    assert line in rendered.splitlines()


def test_the_watch_says_an_outage_before_any_client_is_refused(
    board: Board, objects: list[ObjectRef], serve, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay's own watch of LATEST (a long-poll is held) finds the store offline: it is
    counted and said at once, while no client has been answered an error, and the age of
    LATEST grows; back online, one ``upstream_up`` and the age falls back."""
    store = Counting(board.store)
    relay = serve(store)
    c = client(relay)
    held = c.held()
    caplog.set_level(logging.INFO, logger="rollpatch.relay")
    assert c.wait_newer(KEY, -1, 30.0, held) is not None  # the watch runs
    out: list[bytes | None] = []
    t = threading.Thread(target=lambda: out.append(c.wait_newer(KEY, 4, 60.0, c.held())))
    t.start()
    try:
        metrics = relay.relay.metrics
        store.offline = True
        until(lambda: _said(caplog, "upstream_down"), "the watch to say the outage")
        errors = "rollpatch_relay_upstream_errors_total"
        until(lambda: metrics.value(errors, op="get", reason="transient") >= 3, "more failures")
        until(lambda: relay.relay.watch.latest_age() > 0.5, "LATEST to age")
        assert len(_said(caplog, "upstream_down")) == 1
        assert _said(caplog, "upstream_down")[0].rp_fields["key"] == KEY  # type: ignore[attr-defined]
        text = metrics.render()
        assert not re.search(r'^rollpatch_relay_requests_total\{.*status="5', text, re.MULTILINE)
        age = re.search(r"^rollpatch_relay_upstream_latest_age_seconds (\S+)$", text, re.MULTILINE)
        assert age and float(age.group(1)) > 0.5
        store.offline = False
        until(lambda: _said(caplog, "upstream_up"), "the watch to say the upstream is back")
        # read again within the watch's backoff (5 s), long before the held poll ends (30 s)
        fresh = "LATEST to be fresh again"
        until(lambda: relay.relay.watch.latest_age() < 0.5, fresh, timeout=15.0)
        assert len(_said(caplog, "upstream_up")) == 1
        assert len(_said(caplog, "upstream_down")) == 1
    finally:
        relay.relay.watch.close()  # the held long-poll answers now
        t.join(30)


def _metrics_section() -> str:
    text = DOCS.read_text()
    start = text.index("## Metrics")
    return text[start : text.index("\n## ", start + 1)]


def test_the_docs_name_every_series_and_label_value(
    board: Board, objects: list[ObjectRef], serve
) -> None:
    """docs/relay.md's metrics table lists every family /metrics exports and every value of
    the bounded labels the code chooses from."""
    relay = serve(board.store)
    text = httpx.get(f"{relay.url}/metrics", timeout=10).text
    families = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE)
    assert len(families) >= 18
    docs = _metrics_section()
    missing = [name for name, _ in families if f"`{name}" not in docs]
    for name, _ in families:  # named after another of its row (`..._cache_misses_total`)
        if name in missing and f"`..._{name.removeprefix('rollpatch_relay_')}" in docs:
            missing.remove(name)
    assert not missing, missing
    values = {
        "method": relay_metrics.METHODS | {"other"},
        "op": upstream.OPS,
        "upstream reason": upstream.REASONS,
        "unannounced reason": unannounced.REASONS,
    }
    for label, names in values.items():
        for value in names:
            assert f"`{value}`" in docs, (label, value)
