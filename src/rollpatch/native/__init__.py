"""The compiled core of the codec and of view digests (C, built by ``pip install``).

``rollpatch.native.core`` is the extension module, or ``None`` when it is not built (or when
``ROLLPATCH_NATIVE=0``): callers then use the numpy reference implementation, which produces
the same bytes. A core that is there but does not load (another glibc or Python) is one
WARNING at import, kept in ``load_error``; ``rollpatch --version`` says which runs
(:func:`describe`). ``require()`` raises a clear error where the native core is mandatory.
Why C and the CPython API: no build dependency beyond setuptools and the system compiler,
plain buffers in (numpy arrays, bytes, torch CPU tensors via ``.numpy()``), the GIL released
around every loop, and one pure-C core that a libFuzzer harness links directly
(docs/patch-format.md §8).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

from ..errors import BaseMismatchError, ConfigError, PatchDecodeError
from ..kinds import Kind, single_context

__all__ = [
    "CHUNK",
    "ISAS",
    "core",
    "describe",
    "isa",
    "kind_tuple",
    "load_error",
    "parallel_map",
    "require",
    "threads",
]

#: Elements per independently coded chunk of ``rp.ctxgolomb.v2`` (fixed by the format).
CHUNK = 1 << 20

_ORDERS = {"signmag": 0, "twos": 1, "unsigned": 2}

#: The core's instruction-set levels, lowest first (``ROLLPATCH_ISA`` takes these names).
ISAS = ("scalar", "avx2", "avx512")


def _load() -> tuple[ModuleType | None, str | None]:
    """(the core, why it is not loaded: None when it is, or when ``ROLLPATCH_NATIVE=0``)."""
    if os.environ.get("ROLLPATCH_NATIVE", "1") == "0":
        return None, None
    try:
        from . import _rpcore  # type: ignore[attr-defined]
    except ImportError as e:  # not built, or built for another glibc or Python
        why = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        logging.getLogger("rollpatch.native").warning(
            "the native codec core did not load (%s): the numpy reference runs instead, "
            "same bytes, several times slower; %s",
            why,
            _BUILD_HINT,
        )
        return None, why
    _rpcore.set_errors(PatchDecodeError, BaseMismatchError)
    if _rpcore.CHUNK != CHUNK:
        raise ImportError("rollpatch native core was built for another chunk size")
    asked = os.environ.get("ROLLPATCH_ISA")
    if asked and asked not in ISAS:  # the core ignores it: say so, not run the best silently
        logging.getLogger("rollpatch.native").warning(
            "ROLLPATCH_ISA=%s is not one of %s: ignored (the best level this CPU runs is used)",
            asked,
            ", ".join(ISAS),
        )
    return _rpcore, None


#: How to get the core built (a checkout, or an installed package).
_BUILD_HINT = (
    "build it: `pip install -e .` in a checkout, or `pip install --force-reinstall "
    "--no-binary rollpatch rollpatch` (both need a C compiler); ROLLPATCH_NATIVE=0 runs the "
    "reference without this warning"
)

core, load_error = _load()


def isa(level: str | None = None) -> tuple[str, str]:
    """(level in use, best level this CPU runs) of the core's loops. With ``level`` (one of
    :data:`ISAS`, or ``"default"``) force it first: every level gives the same bytes, so tests
    run each on one machine; a level above the CPU's best runs as the best."""
    c = require()
    if level is None:
        used, best = c.isa()
    elif level == "default":
        used, best = c.isa(-1)
    elif level in ISAS:
        used, best = c.isa(ISAS.index(level))
    else:
        raise ConfigError(f"unknown instruction-set level {level!r}", hint=f"one of {ISAS}")
    return ISAS[used], ISAS[best]


def require() -> ModuleType:
    """The native core, or a ConfigError that says how to build it."""
    if core is None:
        off = load_error is None  # ROLLPATCH_NATIVE=0
        raise ConfigError(
            "the native codec core is " + ("turned off" if off else "not loaded"),
            reason="ROLLPATCH_NATIVE=0" if off else load_error,
            hint="unset ROLLPATCH_NATIVE" if off else _BUILD_HINT,
        )
    return core


def describe() -> str:
    """What ``rollpatch --version`` says of the core: its instruction-set level, or why the
    numpy reference runs instead."""
    if core is None:
        return (
            "native core off (ROLLPATCH_NATIVE=0)"
            if load_error is None
            else (f"native core NOT LOADED ({load_error}): numpy reference")
        )
    used, best = isa()
    return f"native core {used}" + ("" if used == best else f" (CPU runs {best})")


def kind_tuple(kind: Kind, n_elements: int) -> tuple[int, int, int, int]:
    """(bits, order, ctx_shift, ctx_bits) as the core takes them; one context for small
    tensors (docs/patch-format.md §4)."""
    single = single_context(kind, n_elements)
    return (
        kind.bits,
        _ORDERS[kind.order],
        0 if single else kind.ctx_shift,
        0 if single else kind.ctx_bits,
    )


def threads() -> int:
    """Threads for one tensor's chunks: the cores this process may run on (a process pinned
    to fewer cores than the machine has, like vLLM's CPU worker, gets no more threads than
    its cores); ``ROLLPATCH_THREADS`` overrides it."""
    env = os.environ.get("ROLLPATCH_THREADS")
    if env:
        return max(1, int(env))
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def parallel_map(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` on up to :func:`threads` threads (the core drops the GIL)."""
    if len(items) <= 1 or threads() <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(threads(), len(items))) as pool:
        return list(pool.map(fn, items))
