"""Where a staging run's memory goes: the worker's resident set sampled while it stages.

The worker's peak memory over a commit is a promise (docs/engines.md: weights + 2× the staged
update), so each staging run measures it by phase. A thread reads ``/proc/self/statm`` every
millisecond; :meth:`MemTrace.mark` closes a phase and records the highest resident set seen
in it, above the resident set when staging began. Linux only (elsewhere every figure is 0);
the sampling costs one small file read per millisecond on a thread that sleeps in between.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["MemTrace", "rss_bytes", "trim"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_LIBC: Any = None


def trim() -> float:
    """Give the memory freed since the last call back to the system (glibc ``malloc_trim``:
    freed chunks of every arena, not only the top of the heap); returns the ms it took, 0
    where the C library has no such call.

    Why: a commit frees a staged update, the packed kernels it replaced and the scratch of a
    staging thread, and each staging thread allocates in its own malloc arena; without a
    trim, glibc keeps those pages (its mmap threshold also rises to the largest block freed,
    so later large arrays come from the arenas too) and the worker's resident set grew by
    ~60 MiB per commit at 103M (2.06 → 2.44 GiB over six commits)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - raises AttributeError off glibc
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return 0.0
    t0 = time.perf_counter()
    _LIBC.malloc_trim(0)
    return (time.perf_counter() - t0) * 1e3


def rss_bytes() -> int:
    """This process's resident set now (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class MemTrace:
    """Peak resident set per phase of one staging run, in MiB above its start (``phases``),
    plus ``held``: what stays resident when the run ends (the staged update and any buffers
    built for the pause). Use as a context manager; :meth:`mark` ends each phase."""

    def __init__(self, period_s: float = 0.001) -> None:
        self._period = period_s
        self._start = rss_bytes()
        self._peak = self._start
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rollpatch-mem")
        #: Phase name → peak MiB above the start of the run, in the order marked.
        self.phases: dict[str, float] = {}
        self.held = 0.0

    def __enter__(self) -> MemTrace:  # noqa: PYI034 - final class
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.held = (rss_bytes() - self._start) / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def _sample(self) -> int:
        now = rss_bytes()
        with self._lock:
            self._peak = max(self._peak, now)
        return now

    def mark(self, phase: str) -> None:
        """End ``phase``: its peak (sampled, and read once more now) is recorded."""
        now = self._sample()
        with self._lock:
            self.phases[phase] = (self._peak - self._start) / 2**20
            self._peak = now

    @property
    def peak(self) -> float:
        """The run's peak so far, MiB above its start."""
        return max(self.phases.values(), default=0.0)

    def report(self) -> dict[str, float]:
        """``{phase}_mib`` for each phase, ``peak_mib``, ``held_mib`` and ``start_mib``."""
        out = {f"{k}_mib": round(v, 1) for k, v in self.phases.items()}
        out["peak_mib"] = round(self.peak, 1)
        out["held_mib"] = round(self.held, 1)
        out["start_mib"] = round(self._start / 2**20, 1)
        return out
