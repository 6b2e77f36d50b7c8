"""pytest plugin for CI (``-p cpu_report``, ``.ci`` on ``PYTHONPATH``): where the CPU goes.

On these 2-core machines the test jobs share the cores, so a module's wall time says little;
its CPU time says what it costs everyone. Per test module: its tests, wall seconds, the pytest
process's own CPU seconds and the CPU seconds of the child processes it reaped (servers and
workers it started and waited for; a process still running when the module ends, like the
session's shared vLLM server, is not counted). Prints the 25 costliest modules and the totals.
"""

from __future__ import annotations

import resource
import time
from typing import Any

_started: dict[str, tuple[float, float, float]] = {}
#: module -> [tests, wall s, own CPU s, children's CPU s]
_modules: dict[str, list[float]] = {}


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _started[nodeid] = (time.monotonic(), *_cpu())


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    start = _started.pop(nodeid, None)
    if start is None:
        return
    own, kids = _cpu()
    row = _modules.setdefault(nodeid.split("::")[0], [0, 0.0, 0.0, 0.0])
    row[0] += 1
    row[1] += time.monotonic() - start[0]
    row[2] += own - start[1]
    row[3] += kids - start[2]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _modules:
        return
    rows = sorted(_modules.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))
    w = terminalreporter.write_line
    w("")
    w(f"CPU by test module (the 25 costliest of {len(rows)})")
    w(f"{'module':52} {'tests':>6} {'wall s':>8} {'CPU s':>8} {'own':>8} {'children':>8}")
    for name, (n, wall, own, kids) in rows[:25]:
        w(f"{name:52} {n:6.0f} {wall:8.1f} {own + kids:8.1f} {own:8.1f} {kids:8.1f}")
    total = [sum(r[i] for _, r in rows) for i in range(4)]
    own, kids = _cpu()
    w(
        f"{'all modules':52} {total[0]:6.0f} {total[1]:8.1f} {total[2] + total[3]:8.1f} "
        f"{total[2]:8.1f} {total[3]:8.1f}"
    )
    w(f"this pytest process in all (collection, fixtures, servers reaped): {own + kids:.1f} s CPU")
