"""What each method of ``bench/peers.py`` imports, checked before anything runs.

A missing package used to surface as a raw ``ModuleNotFoundError`` after the versions were
prepared and the first methods had run (shardcast: ~50 s in). :func:`missing` finds every
module the requested methods (and ``--trainer-cast torch``) need with
:func:`importlib.util.find_spec`, which imports nothing, and names the one ``pip install``
that brings them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

__all__ = ["NEEDS", "TORCH", "missing"]

#: (modules, the install that brings them) per method. Every method but shardcast runs
#: ``rollpatch relay`` (the ``web`` extra); the XOR peer checks its frames with xxhash (the
#: ``dev`` extra, as in the tests); shardcast is the ``bench`` extra.
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "rollpatch": (("fastapi", "uvicorn", "httpx"), "pip install -e '.[web]'"),
    "xor": (("fastapi", "uvicorn", "httpx", "xxhash"), "pip install -e '.[web,dev]'"),
    "shardcast": (("shardcast",), "pip install -e '.[bench]'"),
}
#: ``--trainer-cast torch``: the trainer process imports torch.
TORCH: tuple[tuple[str, ...], str] = (
    ("torch",),
    "pip install -e '.[torch]' (or --trainer-cast numpy)",
)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def missing(methods: Iterable[str], *, torch: bool) -> str | None:
    """One line naming what the requested methods cannot import and how to install it;
    None when everything is there."""
    wanted = [(m, NEEDS[m]) for m in methods]
    if torch:
        wanted.append(("--trainer-cast torch", TORCH))
    gaps = []
    for what, (modules, install) in wanted:
        absent = [m for m in modules if not _importable(m)]
        if absent:
            gaps.append(f"{what} needs {', '.join(absent)} ({install})")
    if not gaps:
        return None
    return "bench/peers.py: missing packages: " + "; ".join(gaps)
