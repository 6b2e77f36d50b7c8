"""One way to declare and validate a config field (rollpatch.config): every config class
declares its fields with setting(), and each declared bound is the one enforced.

The cases are made from the declarations themselves: for every numeric field, the values just
outside its bounds (and a bool, a NaN, a string) are refused with ``Class.field must be``;
every Literal mode refuses a misspelling; the defaults are valid.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

from rollpatch.cli.demo import CodecWalk
from rollpatch.config import Declared, check_fields, setting, settings
from rollpatch.demo.config import DemoConfig
from rollpatch.errors import ConfigError
from rollpatch.follower import FollowerConfig
from rollpatch.formats import QuantPolicy
from rollpatch.gateway import GatewayConfig
from rollpatch.netem.config import LinkConfig
from rollpatch.publisher import PublisherConfig
from rollpatch.relay import RelayConfig
from rollpatch.serving import BodyLimits, ServeOptions
from rollpatch.sidecar import SidecarConfig
from rollpatch.sim.config import SimConfig
from rollpatch.sim.moe import MoEConfig
from rollpatch.store.config import HttpConfig, S3Config

#: Each config class, the arguments it requires, and the fields it leaves undeclared (why).
CONFIGS: list[tuple[type, dict[str, Any], set[str]]] = [
    (FollowerConfig, {}, set()),
    (RelayConfig, {"cache_dir": Path("/nonexistent/cache")}, set()),
    (GatewayConfig, {}, set()),
    (SidecarConfig, {}, set()),
    (PublisherConfig, {}, set()),
    (S3Config, {"bucket": "b"}, set()),
    (HttpConfig, {}, set()),
    (LinkConfig, {"upstream": ("127.0.0.1", 9)}, set()),
    (SimConfig, {}, {"moe"}),  # MoEConfig is named for the type checker only (an import cycle)
    (MoEConfig, {}, set()),
    (BodyLimits, {}, set()),
    (ServeOptions, {}, set()),
    (DemoConfig, {}, set()),
    (CodecWalk, {}, set()),
    (QuantPolicy, {}, set()),
]
IDS = [cls.__name__ for cls, _, _ in CONFIGS]


def _bad_values(d: Declared) -> list[object]:
    s, tp = d.setting, d.type
    if get_origin(tp) is Literal or s.choices is not None:
        return ["", "nope", 3]
    if tp is bool:
        return [1, "yes"]
    if tp not in (int, float):
        return []
    assert s.lo is not None
    step = 1 if tp is int else 1e-9 * max(1.0, abs(s.lo))
    out: list[object] = [s.lo if s.lo_open else s.lo - step, True, "1"]
    if s.hi is not None:
        hstep = 1 if tp is int else 1e-9 * max(1.0, abs(s.hi))
        out.append(s.hi if s.hi_open else s.hi + hstep)
    if tp is float:
        out += [math.nan, math.inf]
    else:
        out.append(float(s.lo) + 0.5)
    return out


@pytest.mark.parametrize("cls, required, undeclared", CONFIGS, ids=IDS)
def test_every_field_is_declared_and_the_defaults_are_valid(
    cls: type, required: dict[str, Any], undeclared: set[str]
) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    assert names - set(settings(cls)) == undeclared
    assert all(d.setting.help for d in settings(cls).values())
    cls(**required)


CASES = [
    (cls, required, name, bad)
    for cls, required, _ in CONFIGS
    for name, d in settings(cls).items()
    for bad in _bad_values(d)
]


@pytest.mark.parametrize(
    "cls, required, name, bad",
    CASES,
    ids=[f"{c.__name__}.{n}={b!r}" for c, _, n, b in CASES],
)
def test_each_declared_bound_is_enforced(
    cls: type, required: dict[str, Any], name: str, bad: object
) -> None:
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{name} must be ") as e:
        cls(**{**required, name: bad})
    assert e.value.context["field"] == name


#: Fields whose bound is also a rule between fields (top_k <= experts, window >= chunk).
_RELATED = {(MoEConfig, "top_k"), (MoEConfig, "experts"), (LinkConfig, "window_bytes")}


def test_the_bounds_themselves_are_accepted() -> None:
    for cls, required, _ in CONFIGS:
        for name, d in settings(cls).items():
            s = d.setting
            if d.type not in (int, float) or s.lo is None or s.lo_open:
                continue
            if (cls, name) in _RELATED:
                continue
            cls(**{**required, name: d.type(s.lo)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Toy:
    mode: Literal["a", "b"] = setting("a", help="a mode")
    flag: bool = setting(True, help="a switch")
    name: str = setting("x", hi=3, help="a short name")
    empty_ok: str = setting("", lo=0, help="may be empty")
    ratio: float | None = setting(None, lo=0.0, hi=1.0, hi_open=True, help="a ratio")
    pair: tuple[int, int] = setting((1, 2), help="left to the class")

    def __post_init__(self) -> None:
        check_fields(self)


def test_the_rules_by_annotation() -> None:
    _Toy()
    _Toy(ratio=0.0, empty_ok="", name="abc", pair=("not", "checked"))  # type: ignore[arg-type]
    for kw, msg in [
        ({"mode": "c"}, "_Toy.mode must be one of a, b"),
        ({"flag": 0}, "_Toy.flag must be true or false"),
        ({"name": "abcd"}, "_Toy.name must be a non-empty string of at most 3 characters"),
        ({"name": ""}, "_Toy.name must be a non-empty string"),
        ({"empty_ok": 3}, "_Toy.empty_ok must be a string"),
        ({"ratio": 1.0}, "_Toy.ratio must be a finite number >= 0 and < 1"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            _Toy(**kw)
    assert get_args(settings(_Toy)["mode"].type) == ("a", "b")
    assert settings(_Toy)["ratio"].optional


def test_a_number_without_a_lower_bound_is_a_programming_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class Loose:
        n: int = setting(1, help="no bounds")

        def __post_init__(self) -> None:
            check_fields(self)

    with pytest.raises(TypeError, match="needs lo="):
        Loose()
