"""The sidecar protocol as pure functions: constraint parsing, decisions, annotations."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollpatch.errors import ConfigError
from rollpatch.sidecar.protocol import (
    annotate_body,
    annotate_sse_line,
    decide,
    label_body,
    parse_constraint,
)
from rollpatch.types import Constraint


def test_parse_body_and_headers() -> None:
    body = {"prompt": "x", "rollpatch": {"min_version": 3, "wait_s": 0}}
    c = parse_constraint(body, {"X-Rollpatch-Max-Lag": "2", "X-Rollpatch-Min-Version": "9"})
    assert "rollpatch" not in body
    assert c == Constraint(min_version=3, max_lag=2, wait_s=0.0)
    assert parse_constraint({}, {}) == Constraint()


def test_a_bad_value_is_named_where_the_caller_sent_it() -> None:
    """A header's bad value names the header; a body field's, the field; a header the body
    overrides is not read at all."""
    with pytest.raises(ConfigError, match="X-Rollpatch-Min-Version must be a whole number"):
        parse_constraint({}, {"x-rollpatch-min-version": "abc"})
    with pytest.raises(ConfigError, match="X-Rollpatch-Max-Lag must be a whole number"):
        parse_constraint({}, {"x-rollpatch-max-lag": "1.5"})
    with pytest.raises(ConfigError, match="rollpatch.max_lag must be a whole number"):
        parse_constraint({"rollpatch": {"max_lag": 1.5}}, {})
    # a header is bounded as the body is (int64 versions, an hour's wait)
    with pytest.raises(ConfigError, match="X-Rollpatch-Min-Version must be between 0 and"):
        parse_constraint({}, {"x-rollpatch-min-version": "1" + "0" * 30})
    with pytest.raises(ConfigError, match="X-Rollpatch-Wait-S must be between 0 and 3600"):
        parse_constraint({}, {"x-rollpatch-wait-s": "99999"})
    body = {"rollpatch": {"min_version": 1}}
    assert parse_constraint(body, {"X-Rollpatch-Min-Version": "abc"}).min_version == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"rollpatch": 3},
        {"rollpatch": {"nope": 1}},
        {"rollpatch": {"min_version": "x"}},
        {"rollpatch": {"min_version": -1}},
        {"rollpatch": {"min_version": 1.5}},
        {"rollpatch": {"wait_s": 99999}},
        {"rollpatch": {"exact_version": True}},
    ],
)
def test_parse_rejects(bad: dict) -> None:
    with pytest.raises(ConfigError):
        parse_constraint(bad, {})


@pytest.mark.parametrize(
    "c,served,latest,action",
    [
        (Constraint(), None, 5, "unavailable"),
        (Constraint(), 0, 5, "proxy"),
        (Constraint(min_version=5), 4, 5, "wait"),
        (Constraint(min_version=6), 4, 5, "conflict"),
        (Constraint(min_version=4), 5, 5, "proxy"),
        (Constraint(exact_version=5), 5, 9, "proxy"),
        (Constraint(exact_version=5), 6, 9, "conflict"),
        (Constraint(exact_version=7), 6, 9, "wait"),
        (Constraint(exact_version=10), 6, 9, "conflict"),
        (Constraint(max_lag=1), 7, 9, "wait"),
        (Constraint(max_lag=2), 7, 9, "proxy"),
        (Constraint(max_lag=0), 9, 9, "proxy"),
        (Constraint(max_lag=0), 3, None, "proxy"),
    ],
)
def test_decide(c: Constraint, served: int | None, latest: int | None, action: str) -> None:
    assert decide(c, served, latest).action == action


def test_without_max_lag_latest_never_changes_a_proxy_decision() -> None:
    """What the sidecar's hot path relies on to skip reading a stale LATEST: without max_lag,
    a request that may be proxied is proxied whatever LATEST is (known or not)."""
    latests = [None, *range(8)]
    for served in [None, *range(6)]:
        for c in [Constraint()] + [
            Constraint(**{k: v}) for k in ("min_version", "exact_version") for v in range(6)
        ]:
            actions = {decide(c, served, latest).action == "proxy" for latest in latests}
            assert len(actions) == 1, (c, served)


def test_annotate_trusts_engine_within_bounds() -> None:
    raw = json.dumps({"choices": [], "rollpatch": {"version_start": 4, "version_end": 5}})
    out = json.loads(annotate_body(raw.encode(), 4, 6))
    assert out["rollpatch"] == {"version_start": 4, "version_end": 5}
    out = json.loads(annotate_body(raw.encode(), 5, 6))  # engine claims outside the bounds
    assert out["rollpatch"] == {"version_start": 5, "version_end": 6}
    out = json.loads(annotate_body(b'{"a": 1}', 3, 3))
    assert out["rollpatch"] == {"version_start": 3, "version_end": 3}
    assert annotate_sse_line(b"data: [DONE]", 1, 1) == b"data: [DONE]"
    line = annotate_sse_line(b'data: {"x": 1}', 2, 3)
    assert json.loads(line[6:])["rollpatch"]["version_end"] == 3


def _sglang(meta: dict[str, Any], choices: int = 1) -> bytes:
    return json.dumps({"choices": [{"text": "t"}] * choices, "metadata": meta}).encode()


@pytest.mark.parametrize(
    ("meta", "choices", "versions"),
    [
        ({"weight_version": "5"}, 1, (5, 5)),  # no commit during it: all under 5
        ({"weight_version": "5", "weight_versions": [["4", 0, 9], ["5", 9, 20]]}, 1, (4, 5)),
        (
            {"weight_version": "6", "weight_versions": [{"version": "5", "start": 0, "end": 3}]},
            1,
            (5, 6),
        ),
        ({"weight_version": "5"}, 2, (4, 6)),  # SGLang's metadata is the first choice's
        ({"weight_version": "7"}, 1, (4, 6)),  # outside the sidecar's bounds
        ({"weight_version": "3"}, 1, (4, 6)),
        ({"weight_version": "rollpatch:not-ready"}, 1, (4, 6)),
        ({"weight_version": "5", "weight_versions": [["6", 0, 1]]}, 1, (4, 6)),  # backwards
        ({"weight_version": "5", "weight_versions": [[]]}, 1, (4, 6)),
        ({"weight_version": "5", "weight_versions": "4"}, 1, (4, 6)),
        ({"weight_version": 5}, 1, (4, 6)),  # SGLang's tags are strings
        ({"weight_version": "٥"}, 1, (4, 6)),  # decimal, not ASCII: int() would take it
    ],
)
def test_sglangs_own_versions_narrow_the_label(
    meta: dict[str, Any], choices: int, versions: tuple[int, int]
) -> None:
    """SGLang's metadata says which versions produced an answer: within the sidecar's bounds
    it narrows the label (a commit after the last token is not in it), and the versions
    returned for the headers are the body's."""
    out, start, end = label_body(_sglang(meta, choices), 4, 6)
    want = {"version_start": versions[0], "version_end": versions[1]}
    assert json.loads(out)["rollpatch"] == want and (start, end) == versions
    # a stream's start is already in its headers: only the end is narrowed
    line = annotate_sse_line(b"data: " + _sglang(meta, choices), 4, 6)
    label = json.loads(line[6:])["rollpatch"]
    assert label["version_start"] == 4 and label["version_end"] == versions[1]


def test_annotate_keeps_the_engines_bytes() -> None:
    """The versions are spliced into the engine's JSON as it came (no re-encoding: spacing,
    key order, non-ASCII and a brace inside a string stay); an engine's own versions that
    stand leave the body untouched; bodies that are not a UTF-8 object are re-encoded or kept."""
    raw = '{"id":"c","choices":[{"text":"}é "}],  "usage":{"a": 1}}\n'.encode()
    out = annotate_body(raw, 2, 2)
    assert out == raw[:-2] + b',"rollpatch":{"version_start": 2, "version_end": 2}}\n'
    assert json.loads(out) == {
        **json.loads(raw),
        "rollpatch": {"version_start": 2, "version_end": 2},
    }
    assert annotate_body(b"{ }", 1, 1) == b'{ "rollpatch":{"version_start": 1, "version_end": 1}}'
    own = b'{"rollpatch": {"version_start": 4, "version_end": 5}, "x": 1}'
    assert annotate_body(own, 4, 6) is own
    utf16 = json.dumps({"a": 1}).encode("utf-16")
    assert json.loads(annotate_body(utf16, 1, 1))["rollpatch"]["version_end"] == 1
    assert annotate_body(b"[1]", 1, 1) == b"[1]" and annotate_body(b"{", 1, 1) == b"{"


# -- admission and request bodies (issue 11: one request must not wedge an island) ----------


def test_admission_is_released_on_every_path() -> None:
    import threading

    from rollpatch.engines import ViewEngine
    from rollpatch.errors import NotReadyError
    from rollpatch.sidecar.gate import CommitGate

    gate = CommitGate(ViewEngine(), "drain")
    with pytest.raises(RuntimeError), gate.admit(1.0):
        raise RuntimeError("the engine call blew up after admission")
    with gate.admit(1.0) as slot:
        slot.release()
        slot.release()  # idempotent
    with gate.admit(1.0) as slot:
        owned = slot.hand_off()  # a stream takes it over ...
    assert gate.inflight == 1
    owned.release()  # ... and gives it back when it ends
    assert gate.inflight == 0
    assert gate.run(lambda: "committed") == "committed"  # a drain commit is not held
    # admission that stays closed is a typed 503, never a bare TimeoutError
    entered, release = threading.Event(), threading.Event()

    def slow_commit() -> None:
        entered.set()
        release.wait(10)

    t = threading.Thread(target=gate.run, args=(slow_commit,))
    t.start()
    entered.wait(10)
    try:
        assert not gate.admitting and gate.busy_for() >= 0
        with pytest.raises(NotReadyError):
            gate.admit(0.01)
    finally:
        release.set()
        t.join(10)
    assert gate.admitting and gate.busy_for() == 0 and gate.inflight == 0


def test_pause_mode_labels_never_say_none_during_a_commit() -> None:
    """An adapter reports no version while its bits change (vLLM's does); a response that
    starts or ends meanwhile is labelled with the version the engine held (pause mode: no
    token is made until the commit resumes the engine), never with none."""
    import threading

    from rollpatch.engines import ViewEngine
    from rollpatch.sidecar.gate import CommitGate

    class Flipping(ViewEngine):
        def __init__(self) -> None:
            super().__init__()
            self.v: int | None = 3

        @property
        def version(self) -> int | None:
            return self.v

        def pause(self) -> None:
            pass

        def resume(self) -> None:
            pass

    engine = Flipping()
    gate = CommitGate(engine, "pause")
    slot = gate.admit(1.0)
    inside, done = threading.Event(), threading.Event()

    def commit() -> None:
        engine.v = None  # bits changing
        inside.set()
        done.wait(10)
        engine.v = 4

    t = threading.Thread(target=gate.run, args=(commit,))
    t.start()
    inside.wait(10)
    try:
        assert slot.release() == 3  # a stream ending mid-commit: made by version 3
        with gate.admit(1.0) as late:
            assert late.start == 3
    finally:
        done.set()
        t.join(10)
    assert gate.served() == 4 and gate.admit(1.0).release() == 4
    engine.v = None  # a failed commit that left the engine not ready: none, once idle
    assert gate.served() is None


def test_served_is_read_atomically_with_the_commit_state() -> None:
    """Issue 10's `409 served:null`: an adapter read None mid-commit, the commit ended before
    the gate looked at its busy flag, and the request was labelled none. The version and the
    busy state are now read under one lock, so a commit cannot end between the two reads."""
    import threading

    from rollpatch.engines import ViewEngine
    from rollpatch.sidecar.gate import CommitGate

    finish = threading.Event()

    class Racing(ViewEngine):
        v: int | None = 3
        race = False

        @property
        def version(self) -> int | None:
            v = self.v
            if self.race and v is None:  # let the commit try to end between the two reads
                finish.set()
                threading.Event().wait(0.2)
            return v

    engine = Racing()
    gate = CommitGate(engine, "pause")
    inside = threading.Event()

    def commit() -> None:
        engine.v = None
        inside.set()
        finish.wait(10)
        engine.v = 4

    t = threading.Thread(target=gate.run, args=(commit,))
    t.start()
    inside.wait(10)
    engine.race = True
    try:
        assert gate.served() == 3
    finally:
        engine.race = False
        finish.set()
        t.join(10)
    assert gate.served() == 4


def test_drain_commit_has_a_deadline_then_pauses() -> None:
    """A drain commit waits at most drain_timeout_s for in-flight requests, then pauses the
    engine for the write instead; the gate counts it and records one pause figure."""
    from rollpatch.engines import ViewEngine
    from rollpatch.sidecar.gate import CommitGate

    class Pausing(ViewEngine):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def pause(self) -> None:
            self.calls.append("pause")

        def resume(self) -> None:
            self.calls.append("resume")

    engine = Pausing()
    gate = CommitGate(engine, "drain", drain_timeout_s=0.05)
    slot = gate.admit(1.0)  # a long generation that never ends in time
    assert gate.run(lambda: engine.calls.append("write")) is None
    assert engine.calls == ["pause", "write", "resume"]
    assert gate.drain_timeouts == 1 and gate.last is not None
    assert gate.last.mode == "pause" and gate.last.drain_s >= 0.05 and gate.last.ok
    assert gate.last_pause_s == gate.last.pause_s == gate.pauses[-1]
    slot.release()
    engine.calls.clear()
    gate.run(lambda: engine.calls.append("write"))  # nothing in flight: a plain drain
    assert engine.calls == ["write"] and gate.last.mode == "drain" and gate.drain_timeouts == 1
    with pytest.raises(ConfigError):
        CommitGate(engine, "drain", drain_timeout_s=-1)


@pytest.mark.parametrize(
    "raw, status",
    [
        (b'{"prompt": "x", "temperature": NaN}', 400),
        (b'{"prompt": "x", "temperature": -Infinity}', 400),
        (b'{"prompt": "x", "temperature": 1e400}', 400),
        (b'{"prompt": "x", "prompt": "y"}', 400),
        (b'{"prompt": "\\ud800"}', 400),
        (b'{"a": ' * 65 + b"1" + b"}" * 65, 400),
        (b"[" * 1000, 400),
        (b"[1, 2]", 400),
        (b"\xff\xfe", 400),
        (b'{"prompt": "' + b"x" * 2000 + b'"}', 413),
    ],
)
def test_body_limits(raw: bytes, status: int) -> None:
    import asyncio

    from rollpatch.errors import ConfigError as Refused
    from rollpatch.serving.body import BodyLimits, parse_json_object, read_body, refusal_status

    class FakeRequest:
        def __init__(self) -> None:
            self.headers: dict[str, str] = {}

        async def stream(self):  # type: ignore[no-untyped-def]
            for i in range(0, len(raw), 512):
                yield raw[i : i + 512]

    limits = BodyLimits(max_bytes=1024, max_depth=64)
    with pytest.raises(Refused) as e:
        data = asyncio.run(read_body(FakeRequest(), limits))  # type: ignore[arg-type]
        parse_json_object(data, limits)
    assert refusal_status(e.value) == status
    assert parse_json_object(b'{"a": [1.5, "\\ud83d\\ude00"]}', limits) == {"a": [1.5, "😀"]}


def test_body_limits_config_is_validated() -> None:
    from rollpatch.serving.body import BodyLimits

    for bad in ({"max_bytes": 0}, {"max_depth": 0}, {"timeout_s": float("nan")}):
        with pytest.raises(ConfigError):
            BodyLimits(**bad)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"prompt": "x", "stop": ["a"] * 1000}, "stop: List should have at most 64 items"),
        ({"prompt": [-5]}, "prompt.0: Input should be greater than or equal to 0"),
        ({"prompt": "x", "stop": "a" * 5000}, "stop: String should have at most 4096 characters"),
        ({"prompt": "x", "max_tokens": -1, "n": 0}, "max_tokens: Input should be greater"),
    ],
)
def test_a_refused_body_names_the_bound_it_broke(body: dict[str, Any], said: str) -> None:
    """A field of several forms (a string or a list) fails once per form: the message is the
    form the value has and the bound it broke, not "stop.constrained-str: Input should be a
    valid string (and 1 more)"."""
    from rollpatch.serving.schema import validate_body

    with pytest.raises(ConfigError) as err:
        validate_body("/v1/completions", body)
    assert said in err.value.message and "constrained" not in err.value.message, err.value


def test_constraint_fields_are_typed_not_coerced() -> None:
    """``"min_version": "1"``, ``1.0`` and ``true`` in the body, and headers such as ``1_0``
    (Python's ``int()`` reads 10), ``+0`` or `` 1`` were taken (an audit's LOW finding,
    session 39): a version is a JSON integer in the body and plain digits in a header."""
    for bad in ("1", 1.0, True, [1]):
        with pytest.raises(ConfigError, match="rollpatch.min_version must be a whole number"):
            parse_constraint({"rollpatch": {"min_version": bad}}, {})
    for bad in ("1_0", "+0", " 1", "1 ", "0x1", "1e3", ""):
        with pytest.raises(ConfigError, match="X-Rollpatch-Min-Version must be a whole number"):
            parse_constraint({}, {"x-rollpatch-min-version": bad})
    for bad in ("1_0", "+1", "1e3", "nan", ".5"):
        with pytest.raises(ConfigError, match="X-Rollpatch-Wait-S must be a number of seconds"):
            parse_constraint({}, {"x-rollpatch-wait-s": bad})
    c = parse_constraint(
        {"rollpatch": {"min_version": 3, "wait_s": 1.5}}, {"x-rollpatch-max-lag": "2"}
    )
    assert (c.min_version, c.max_lag, c.wait_s) == (3, 2, 1.5)
    assert parse_constraint({}, {"x-rollpatch-wait-s": "0.25"}).wait_s == 0.25


def test_a_chat_of_too_many_messages_is_refused_before_the_engine() -> None:
    """200,000 one-letter messages (6.8 MB, under the body limit) cost the built-in engine
    ~24 s of CPU in its chat template before its context-length 400 (an audit's LOW finding,
    session 39): more than MAX_MESSAGES is a 400 at the service's edge."""
    from rollpatch.serving.schema import MAX_MESSAGES, validate_body

    many = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    with pytest.raises(ConfigError, match=f"messages: List should have at most {MAX_MESSAGES}"):
        validate_body("/v1/chat/completions", {"messages": many})
    validate_body("/v1/chat/completions", {"messages": many[:MAX_MESSAGES]})
