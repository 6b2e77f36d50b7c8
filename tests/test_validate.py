"""One way to validate configuration: every config class built on rollpatch.validate refuses a
bad field the same way (ConfigError naming Class.field, with field and value in context)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rollpatch.errors import ConfigError
from rollpatch.follower import FollowerConfig
from rollpatch.netem.config import LinkConfig
from rollpatch.relay import RelayConfig
from rollpatch.store.config import HttpConfig, S3Config
from rollpatch.validate import check_choice, check_int, check_number


def _follower(**kw: Any) -> Any:
    return FollowerConfig(**kw)


def _relay(**kw: Any) -> Any:
    return RelayConfig(cache_dir=Path("/nonexistent/cache"), **kw)


def _s3(**kw: Any) -> Any:
    return S3Config(bucket="b", **kw)


def _http(**kw: Any) -> Any:
    return HttpConfig(**kw)


def _link(**kw: Any) -> Any:
    return LinkConfig(upstream=("127.0.0.1", 9), **kw)


CASES = [
    (_follower, "FollowerConfig", "poll_s", [0, -1.0, math.nan, math.inf, True, "1"]),
    (_follower, "FollowerConfig", "fetch_workers", [0, 257, 2.0, True, None]),
    (_relay, "RelayConfig", "pointer_ttl", [-0.1, math.nan, True, "0.5"]),
    (_relay, "RelayConfig", "list_page", [0, 1.5, False]),
    (_s3, "S3Config", "part_size", [1, 6 * 1024**3, 8.0 * 2**20, True]),
    (_s3, "S3Config", "max_workers", [0, "8", True]),
    (_s3, "S3Config", "read_timeout", [0, -1, math.inf, None]),
    (_s3, "S3Config", "addressing_style", ["Path", "", 3]),
    (_http, "HttpConfig", "timeout", [0, math.nan, "30"]),
    (_http, "HttpConfig", "retries", [-1, 1.0, True]),
    (_link, "LinkConfig", "loss", [0.6, -0.1, math.nan, True]),
    (_link, "LinkConfig", "max_connections", [0, 65537, 1.0]),
]


@pytest.mark.parametrize(
    "make, owner, field, bad", [(m, o, f, b) for m, o, f, bads in CASES for b in bads]
)
def test_a_bad_field_is_one_kind_of_error(make: Any, owner: str, field: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{owner}\.{field} must be ") as e:
        make(**{field: bad})
    assert e.value.context["field"] == field
    assert e.value.context.get("value") is bad or e.value.context.get("value") == bad


def test_the_defaults_are_valid() -> None:
    for make in (_follower, _relay, _s3, _http, _link):
        make()


def test_the_helpers() -> None:
    check_int("C", "n", 3, 1, 3)
    check_number("C", "x", 0.5, 0.0, 1.0, lo_open=True)
    check_choice("C", "mode", "a", ("a", "b"))
    with pytest.raises(ConfigError, match=r"C.n must be an integer in \[1, 3\]"):
        check_int("C", "n", 4, 1, 3)
    with pytest.raises(ConfigError, match=r"C.x must be a finite number > 0 and <= 1"):
        check_number("C", "x", 0.0, 0.0, 1.0, lo_open=True)
    with pytest.raises(ConfigError, match="C.mode must be one of a, b"):
        check_choice("C", "mode", "c", ("a", "b"))
