"""Command-line flags made from a config class's own fields (:mod:`rollpatch.config`).

``add_config_flags(p, Config, ...)`` adds one flag per declared field: its name (``--`` + the
field name with ``_s`` dropped, unless the setting names another), its type, choices, help and
default come from the declaration, so a default is written once, in the config class.
``config_kwargs(args, Config)`` gives back the fields the flags set, for ``Config(**kwargs)``,
which validates them (a bad value: one line, exit 2). A field the command sets another way (a
secret read from a file, a nested config) is named in ``skip`` and left to the command.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import MISSING
from typing import Any, Literal, get_args, get_origin

from ..config import Declared, parse_size, settings

__all__ = ["add_config_flags", "config_kwargs", "flag_name"]

_SIZE_UNITS = (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))


def flag_name(d: Declared) -> str:
    """The flag of a declared field."""
    if d.setting.flag is not None:
        return d.setting.flag
    name = d.name.removesuffix("_s")
    return "--" + name.replace("_", "-")


def _none_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() == "none" else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def _metavar(d: Declared) -> str:
    if d.type is int:
        return "N"
    if d.type is float:
        seconds = d.name.endswith(("_s", "_ttl")) and not d.name.endswith("per_s")
        return "S" if seconds else "X"
    return d.name.upper()


def _default_text(value: Any, d: Declared) -> str:
    if d.setting.parse is parse_size and isinstance(value, int):
        unit = next((u for u, n in _SIZE_UNITS if value % n == 0), "")
        return f"{value // dict(_SIZE_UNITS).get(unit, 1)}{unit}"
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def add_config_flags(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
) -> None:
    """One flag per declared field of ``cls`` (all of them, or ``only`` these), but ``skip``."""
    wanted = None if only is None else set(only)
    skipped = set(skip)
    pairs: list[tuple[str, str]] = []
    for name, d in settings(cls).items():
        if name in skipped or (wanted is not None and name not in wanted):
            continue
        s, tp = d.setting, d.type
        kwargs: dict[str, Any] = {}
        default = d.default
        if default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if get_origin(tp) is Literal or s.choices is not None:
            kwargs["choices"] = s.choices if s.choices is not None else get_args(tp)
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            parse = s.parse or (tp if tp in (int, float, str) else str)
            kwargs["type"] = _none_or(parse) if d.optional else parse
        if s.metavar or "type" in kwargs:
            kwargs["metavar"] = s.metavar or _metavar(d)
        computed = d.field.default_factory is not MISSING  # its help says what it is
        shown = "" if default is MISSING or computed else f" (default {_default_text(default, d)})"
        if d.optional and default is not None and default is not MISSING:
            shown = shown[:-1] + "; none: off)"
        kwargs["help"] = (s.help + shown).replace("%", "%%")
        action = p.add_argument(flag_name(d), **kwargs)
        pairs.append((name, action.dest))
    p.set_defaults(**{_key(cls): tuple(pairs)})  # a group shares its parser's defaults


def config_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of the flags :func:`add_config_flags` made for ``cls``, by field name."""
    pairs: tuple[tuple[str, str], ...] = getattr(args, _key(cls), ())
    return {name: getattr(args, dest) for name, dest in pairs}


def _key(cls: type) -> str:
    return f"_config_{cls.__module__}.{cls.__qualname__}"
