"""One way to validate a configuration field.

Every config class checks its fields in ``__post_init__`` with these helpers, so every bad
value gets the same kind of error: a :class:`~rollpatch.errors.ConfigError` whose message
names the class and the field (``"FollowerConfig.poll_s must be a finite number > 0 and
<= 86400"``) and whose context carries ``field`` and ``value``. ``bool`` is never accepted as
a number (``True`` is an ``int`` to Python, never to a user), and numbers must be finite.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from .errors import ConfigError

__all__ = ["check_choice", "check_int", "check_number"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(owner: str, name: str, value: object, lo: int, hi: int | None = None) -> None:
    """``value`` is an integer in ``[lo, hi]`` (``hi=None``: no upper bound)."""
    if _is_int(value) and lo <= value and (hi is None or value <= hi):  # type: ignore[operator]
        return
    bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ConfigError(f"{owner}.{name} must be an integer {bound}", field=name, value=value)


def check_number(
    owner: str,
    name: str,
    value: object,
    lo: float,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    """``value`` is a finite int or float ``>= lo`` (``> lo`` with ``lo_open``) and ``<= hi``
    (``< hi`` with ``hi_open``)."""
    try:
        x = float(value) if _is_int(value) or isinstance(value, float) else math.nan  # type: ignore[arg-type]
    except OverflowError:  # an int beyond any float: not finite
        x = math.nan
    below = hi is None or (x < hi if hi_open else x <= hi)
    ok = math.isfinite(x) and (x > lo if lo_open else x >= lo) and below
    if ok:
        return
    bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
    if hi is not None:
        bound += f" and < {hi:g}" if hi_open else f" and <= {hi:g}"
    raise ConfigError(f"{owner}.{name} must be a finite number {bound}", field=name, value=value)


def check_choice(owner: str, name: str, value: object, choices: Collection[str]) -> None:
    """``value`` is one of ``choices`` (a mode spelled as a string, e.g. a ``Literal``)."""
    if isinstance(value, str) and value in choices:
        return
    raise ConfigError(
        f"{owner}.{name} must be one of {', '.join(choices)}", field=name, value=value
    )
