"""Shared helpers for the benchmarks: sizes, timing, peak memory, machine facts, tables.

Benchmarks are scripts (``python bench/NAME.py``); Python puts ``bench/`` on ``sys.path``, so
they import this module as ``_util``.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "best_of",
    "cpu_of",
    "current_rss",
    "fmt_size",
    "log",
    "machine",
    "machine_line",
    "parse_size",
    "peak_rss",
    "proc_cpu_s",
    "reset_peak_rss",
    "table",
]


def proc_cpu_s(pid: int | None = None, *, children: bool = False) -> float:
    """CPU seconds (user + system, every thread) a process used so far: this one when ``pid``
    is None (or is this process), else from ``/proc/PID/stat``, with its waited-for children's
    when ``children``. Raises ``OSError`` when the process is gone."""
    if pid is None or pid == os.getpid():
        t = os.times()
        return t.user + t.system + ((t.children_user + t.children_system) if children else 0.0)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11 : 15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def cpu_of(pids: Sequence[int], *, this: bool = True) -> float:
    """CPU seconds used so far by this process (unless ``this`` is False) and ``pids``; a
    process that is gone counts nothing."""
    total = proc_cpu_s() if this else 0.0
    for pid in pids:
        try:
            total += proc_cpu_s(pid)
        except OSError:
            continue
    return total


_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """``"100M"`` → 100_000_000; ``"1.5B"``, ``"20m"``, ``"7000000"`` work too."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KkMmBbGgTt]?)\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 100M, 1B)")
    return round(float(m.group(1)) * _SUFFIX[m.group(2).upper()])


def fmt_size(n: int) -> str:
    """100_000_000 → ``"100M"``; 1_000_000_000 → ``"1B"``."""
    for unit, mult in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= mult:
            return f"{n / mult:.3g}{unit}"
    return str(n)


def best_of(
    fn: Callable[..., Any], repeats: int, setup: Callable[[], Any] | None = None
) -> tuple[float, Any]:
    """Best wall time (``time.perf_counter``) of ``repeats`` calls, and the last result.

    ``setup`` runs untimed before each call; its result is passed to ``fn`` if not None.
    """
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        arg = setup() if setup is not None else None
        t0 = time.perf_counter()
        out = fn(arg) if arg is not None else fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """Peak resident set size of this process, in bytes (VmHWM; ru_maxrss as fallback)."""
    kb = _status_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if sys.platform == "darwin":
            kb //= 1024
    return kb * 1024


def current_rss() -> int:
    """Current resident set size, in bytes (0 where unknown)."""
    kb = _status_kb("VmRSS")
    return (kb or 0) * 1024


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``), so that a
    peak RSS measured next counts every page the measured call touches: memory an earlier
    call freed to the heap is otherwise reused without growing RSS, and a measurement then
    depends on what ran before it. False where unsupported (not glibc)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn(0)
    return True


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def machine() -> dict[str, Any]:
    """Facts that make a benchmark number interpretable."""
    import numpy as np

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_model": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    return info


def machine_line(info: dict[str, Any]) -> str:
    """One line naming the machine, for table footers."""
    mem = f", {info['mem_total_gib']} GiB RAM" if "mem_total_gib" in info else ""
    return (
        f"{info['usable_cores']} usable cores ({info['cpu_model']}){mem}; "
        f"python {info['python']}, numpy {info['numpy']}"
    )


def table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] | None = None
) -> str:
    """Fixed-width text table; numbers right-aligned where ``right`` says so."""
    right = list(right) if right is not None else [True] * len(headers)
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def log(msg: str) -> None:
    """Progress to stderr (stdout carries only the result table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class WarmAdamW:
    """AdamW steps over given FP32 masters (updated in place) whose optimizer state is warm
    analytically, so step 1 looks like a step late in a long RL run. Shared by the sidecar
    and vLLM benches; the simulator (rollpatch.sim) is the calibrated, model-sized version."""

    def __init__(self, masters: dict[str, np.ndarray], lr: float, seed: int = 0) -> None:
        self.masters, self.lr, self.t = masters, lr, 0
        self.rng = np.random.default_rng(seed)
        self.adam = {n: self._warm(m) for n, m in masters.items()}

    def _warm(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        scale = float(self.rng.lognormal(-7.0, 0.5))
        direction = self.rng.standard_normal(m.shape, dtype=np.float32)
        noise = self.rng.standard_normal(m.shape, dtype=np.float32)
        exp_avg = (scale * (0.15 * direction + np.sqrt(0.1 / 1.9) * noise)).astype(np.float32)
        exp_avg_sq = (scale * scale * (1 + 0.0225 * direction * direction)).astype(np.float32)
        return direction, exp_avg, exp_avg_sq, scale

    def step(self) -> None:
        """One AdamW step of every master (synthetic gradients: persistent direction + noise)."""
        self.t += 1
        b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
        n = 1000 + self.t  # Adam state is warm: bias corrections of a long run
        bc1, bc2 = 1 - b1**n, 1 - b2**n
        for name, w in self.masters.items():
            direction, m, v, scale = self.adam[name]
            s = scale * float(np.exp(0.2 * self.rng.standard_normal()))
            g = s * (0.15 * direction + self.rng.standard_normal(w.shape, dtype=np.float32))
            w *= np.float32(1 - self.lr * wd)
            m += np.float32(1 - b1) * (g - m)
            v *= np.float32(b2)
            v += np.float32(1 - b2) * g * g
            w -= np.float32(self.lr / bc1) * m / (np.sqrt(v / np.float32(bc2)) + np.float32(eps))
