"""The sidecar protocol as pure functions: constraint parsing, decisions, annotations."""

from __future__ import annotations

import json

import pytest

from rollpatch.errors import ConfigError
from rollpatch.sidecar.protocol import annotate_body, annotate_sse_line, decide, parse_constraint
from rollpatch.types import Constraint


def test_parse_body_and_headers() -> None:
    body = {"prompt": "x", "rollpatch": {"min_version": 3, "wait_s": 0}}
    c = parse_constraint(body, {"X-Rollpatch-Max-Lag": "2", "X-Rollpatch-Min-Version": "9"})
    assert "rollpatch" not in body
    assert c == Constraint(min_version=3, max_lag=2, wait_s=0.0)
    assert parse_constraint({}, {}) == Constraint()


@pytest.mark.parametrize("bad", [{"rollpatch": 3}, {"rollpatch": {"nope": 1}},
                                 {"rollpatch": {"min_version": "x"}},
                                 {"rollpatch": {"min_version": -1}},
                                 {"rollpatch": {"min_version": 1.5}},
                                 {"rollpatch": {"wait_s": 99999}},
                                 {"rollpatch": {"exact_version": True}}])
def test_parse_rejects(bad: dict) -> None:
    with pytest.raises(ConfigError):
        parse_constraint(bad, {})


@pytest.mark.parametrize("c,served,latest,action", [
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
])
def test_decide(c: Constraint, served: int | None, latest: int | None, action: str) -> None:
    assert decide(c, served, latest).action == action


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
