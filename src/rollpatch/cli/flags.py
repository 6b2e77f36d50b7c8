"""Command-line flags made from a config class's own fields: the command line's name for the
builders in :mod:`rollpatch.config` (``add_config_flags``, ``config_kwargs``, ``flag_name``),
which live there so that a package below the command line (``python -m rollpatch.netem``)
builds its flags the same way.
"""

from __future__ import annotations

import argparse
import math

from ..config import add_config_flags, config_kwargs, flag_name
from ..types import MAX_VERSION

__all__ = [
    "add_config_flags",
    "config_kwargs",
    "count",
    "flag_name",
    "seconds",
    "timeout_seconds",
    "version_number",
]


def _int(text: str, lo: int, hi: int, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"must be {what} (got {value})")
    return value


def version_number(text: str) -> int:
    """An argparse type: a version number (0 to 2**53 - 1, what manifests can hold)."""
    return _int(text, 0, MAX_VERSION, f"a version number, 0 to {MAX_VERSION}")


def count(text: str) -> int:
    """An argparse type: an integer >= 0 (a count, a trainer step)."""
    return _int(text, 0, MAX_VERSION, "an integer >= 0")


def _float(text: str, lo: float, hi: float, *, lo_open: bool) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    low = "(" if lo_open else "["
    if not math.isfinite(value) or not (lo < value if lo_open else lo <= value) or value > hi:
        raise argparse.ArgumentTypeError(f"must be in {low}{lo:g}, {hi:g}] seconds: {text!r}")
    return value


def seconds(text: str) -> float:
    """An argparse type: seconds in [0, 86400] (0 may mean "at once": a grace period)."""
    return _float(text, 0.0, 86400.0, lo_open=False)


def timeout_seconds(text: str) -> float:
    """An argparse type: a timeout in (0, 3600] seconds."""
    return _float(text, 0.0, 3600.0, lo_open=True)
