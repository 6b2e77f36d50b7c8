"""Configuration fields declared once: default, help text, bounds and choices.

A config class is a frozen, keyword-only dataclass whose fields are declared with
:func:`setting`; its ``__post_init__`` calls :func:`check_fields` first, which checks every
declared field by its annotation with the :mod:`rollpatch.validate` helpers (so every bad value
is one kind of :class:`~rollpatch.errors.ConfigError`, naming ``Class.field``):

- ``int`` / ``float``: a number (never a ``bool``) in ``[lo, hi]`` (``lo_open``: ``> lo``,
  ``hi_open``: ``< hi``);
- a ``Literal`` of strings, or ``choices=``: one of them (a mode is a type, not a string);
- ``str``: a string of ``lo`` (default 1) to ``hi`` characters; ``bool``: ``True`` or ``False``;
- ``X | None``: ``None``, or an ``X`` as above; any other class: an instance of it;
- a container (``tuple[int, ...]``): left to the class's ``__post_init__``.

Rules between fields (``top_k <= experts``) stay in ``__post_init__``, after the call.

The command line builds its flags from the same declarations, so a default, a bound or a help
text is written once, in the config class: ``add_config_flags(p, Config, ...)`` adds one flag
per declared field (its name: ``--`` + the field name with ``_s`` dropped, unless the setting
names another; its type, choices, help and default from the declaration; a ``tuple[str, ...]``
field without a parser is a repeatable flag), and ``config_kwargs(args, Config)`` gives back
the fields the flags set, for ``Config(**kwargs)``, which validates them. A field the command
sets another way (a secret read from a file, a nested config) is named in ``skip``. These live
here, below every package with a command line (``rollpatch.netem`` has its own entry point);
:mod:`rollpatch.cli.flags` is the command line's name for them.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from .errors import ConfigError
from .validate import check_choice, check_int, check_number

__all__ = [
    "Declared",
    "Setting",
    "add_config_flags",
    "check_fields",
    "check_value",
    "config_kwargs",
    "flag_name",
    "parse_size",
    "setting",
    "settings",
]

_KEY = "rollpatch.setting"


@dataclass(frozen=True)
class Setting:
    """What :func:`setting` records of one field (besides its default and type)."""

    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    #: Allowed strings, when they are not the field's ``Literal`` type (a runtime registry).
    choices: tuple[str, ...] | None = None
    #: The command-line flag, when it is not ``--`` + the field name (``_s`` dropped).
    flag: str | None = None
    metavar: str | None = None
    #: Parses the flag's text (default: the field's type), e.g. ``"10G"`` → bytes.
    parse: Callable[[str], Any] | None = None
    #: Writes a value as the flag's text, for the help's default (the inverse of ``parse``).
    show: Callable[[Any], str] | None = None
    #: What ``none`` means for an optional field with another default (the help says it).
    none: str = "off"


def setting(
    default: Any = MISSING,
    *,
    help: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    show: Callable[[Any], str] | None = None,
    factory: Callable[[], Any] | None = None,
    none: str = "off",
) -> Any:
    """A dataclass field with its help text and bounds (``factory``: a default computed per
    instance, like ``dataclasses.field(default_factory=...)``)."""
    meta = {
        _KEY: Setting(help, lo, hi, lo_open, hi_open, choices, flag, metavar, parse, show, none)
    }
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Declared:
    """One declared field of a config class: the dataclass field, its setting and its type
    (``optional``: ``None`` is allowed; ``type`` is then the other member of the union)."""

    field: Field[Any]
    setting: Setting
    type: Any
    optional: bool

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        """The default value (MISSING for a required field; computed for a factory)."""
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return MISSING


_DECLARED: dict[type, dict[str, Declared]] = {}


def settings(cls: type) -> dict[str, Declared]:
    """The fields of ``cls`` declared with :func:`setting`, in declaration order."""
    known = _DECLARED.get(cls)
    if known is not None:
        return known
    out: dict[str, Declared] = {}
    for f in fields(cls):
        s = f.metadata.get(_KEY)
        if s is None:
            continue
        tp, optional = _unwrap(_hint(cls, f))
        out[f.name] = Declared(f, s, tp, optional)
    _DECLARED[cls] = out
    return out


def _hint(cls: type, f: Field[Any]) -> Any:
    """One field's annotation, evaluated in its module (other fields may name types that exist
    only for the type checker)."""
    holder = type("_", (), {"__annotations__": {f.name: f.type}, "__module__": cls.__module__})
    return typing.get_type_hints(holder, globalns=vars(sys.modules[cls.__module__]))[f.name]


def _unwrap(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(get_args(tp))
    return tp, False


def check_fields(obj: object) -> None:
    """Check every declared field of ``obj`` (a config instance); ConfigError on the first
    bad one."""
    owner = type(obj).__name__
    for name, d in settings(type(obj)).items():
        value = getattr(obj, name)
        if value is None and d.optional:
            continue
        check_value(owner, name, value, d)


def check_value(owner: str, name: str, value: object, d: Declared) -> None:
    """One field's value against its declaration."""
    s, tp = d.setting, d.type
    if get_origin(tp) is Literal or s.choices is not None:
        choices = s.choices if s.choices is not None else get_args(tp)
        check_choice(owner, name, value, choices)
    elif tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{owner}.{name} must be true or false", field=name, value=value)
    elif tp is int:
        check_int(owner, name, value, int(_lo(s, owner, name)), None if s.hi is None else int(s.hi))
    elif tp is float:
        lo = _lo(s, owner, name)
        check_number(owner, name, value, lo, s.hi, lo_open=s.lo_open, hi_open=s.hi_open)
    elif tp is str:  # lo, hi: bounds on its length (by default at least 1)
        least = 1 if s.lo is None else int(s.lo)
        if not isinstance(value, str) or not least <= len(value) <= (s.hi or len(value)):
            most = "" if s.hi is None else f" of at most {s.hi:g} characters"
            what = "a non-empty string" if least else "a string"
            raise ConfigError(f"{owner}.{name} must be {what}{most}", field=name, value=value)
    elif tp is Path:
        if not isinstance(value, (str, Path)) or not str(value):
            raise ConfigError(f"{owner}.{name} must be a path", field=name, value=value)
    elif get_origin(tp) is not None:
        pass  # a container (tuple[int, ...]): its items are the class's own rule
    elif isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(
            f"{owner}.{name} must be a {tp.__name__}" + (" or None" if d.optional else ""),
            field=name,
            value=type(value).__name__,
        )


def _lo(s: Setting, owner: str, name: str) -> float:
    if s.lo is None:  # a programming error, found by the first instance built
        raise TypeError(f"{owner}.{name}: a numeric setting needs lo=")
    return s.lo


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``"1000"``, ``"512M"``, ``"10G"``, ``"1.5TiB"`` (binary units): the parser
    of a size setting's flag."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 500M, 20G)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return value


# -- command-line flags made from the declarations ---------------------------------------------

_SIZE_UNITS = (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))


def flag_name(d: Declared) -> str:
    """The flag of a declared field."""
    if d.setting.flag is not None:
        return d.setting.flag
    name = d.name.removesuffix("_s")
    return "--" + name.replace("_", "-")


def _checked(parse: Callable[[str], Any], d: Declared) -> Callable[[str], Any]:
    """``parse`` then the field's own check, so that a bad value is refused by its flag's
    name (``argument --workers: must be an integer in [1, 256]``), not the config field's."""

    def parse_checked(text: str) -> Any:
        value = parse(text)
        try:
            check_value("", d.name, value, d)
        except ConfigError as e:
            said = e.message
            at = said.find(" must ")
            raise argparse.ArgumentTypeError(said[at + 1 :] if at >= 0 else said) from None
        return value

    parse_checked.__name__ = getattr(parse, "__name__", "value")
    return parse_checked


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
    if value is None or value == ():
        return "none"
    if d.setting.show is not None:
        return d.setting.show(value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class _Append(argparse.Action):
    """A repeatable flag of a ``tuple[str, ...]`` field: each use adds one item."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))


class _Deprecated(argparse.Action):
    """An old name of a renamed flag: still works, with a one-line warning on stderr."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        print(f"{parser.prog}: warning: {option} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_config_flags(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    rename: Mapping[str, str] | None = None,
    unset: Iterable[str] = (),
) -> None:
    """One flag per declared field of ``cls`` (all of them, or ``only`` these), but ``skip``.

    ``rename``: field → its flag in this command, where the declared name would be vague (the
    sidecar's ``--fetch-timeout``); the declared name stays as a hidden, deprecated alias.
    ``unset``: fields whose flag defaults to None, which :func:`config_kwargs` leaves out so
    that the config's own default applies (a flag two configs of one command share, with
    different defaults)."""
    wanted = None if only is None else set(only)
    skipped, renamed, deferred = set(skip), dict(rename or {}), set(unset)
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
            kwargs["default"] = None if name in deferred else default
        if get_origin(tp) is Literal or s.choices is not None:
            kwargs["choices"] = s.choices if s.choices is not None else get_args(tp)
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(tp) is tuple and get_args(tp)[-1:] == (...,) and s.parse is None:
            kwargs["action"] = _Append
        else:
            parse = _checked(s.parse or (tp if tp in (int, float, str) else str), d)
            kwargs["type"] = _none_or(parse) if d.optional else parse
        if s.metavar or "type" in kwargs:
            kwargs["metavar"] = s.metavar or _metavar(d)
        computed = d.field.default_factory is not MISSING  # its help says what it is
        shown = "" if default is MISSING or computed else f" (default {_default_text(default, d)})"
        if d.optional and default is not None and default is not MISSING:
            shown = shown[:-1] + f"; none: {s.none})"
        kwargs["help"] = (s.help + shown).replace("%", "%%")
        flag = renamed.get(name, flag_name(d))
        action = p.add_argument(flag, **kwargs)
        if flag != flag_name(d):
            extra = {k: kwargs[k] for k in ("type", "choices", "metavar") if k in kwargs}
            p.add_argument(
                flag_name(d),
                dest=action.dest,
                action=_Deprecated,
                new=flag,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
                **extra,
            )
        pairs.append((name, action.dest))
    p.set_defaults(**{_key(cls): (tuple(pairs), tuple(sorted(deferred)))})


def config_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of the flags :func:`add_config_flags` made for ``cls``, by field name (an
    ``unset`` flag that was not given is left out: the config's default applies)."""
    pairs, deferred = getattr(args, _key(cls), ((), ()))
    out = {name: getattr(args, dest) for name, dest in pairs}
    return {k: v for k, v in out.items() if not (k in deferred and v is None)}


def _key(cls: type) -> str:
    return f"_config_{cls.__module__}.{cls.__qualname__}"
