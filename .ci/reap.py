"""Run a command as a child subreaper and print the CPU of everything it started.

A shell's ``times`` counts only the processes that were waited for up the tree: an engine
server's workers killed with their process group (vLLM's engine core, SGLang's schedulers) are
re-parented to init and their CPU is lost, a quarter or more of the live jobs' CPU. As a
subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) this process adopts every orphan of the tree and
reaps it, so its children's rusage is the whole run's CPU.

Usage: ``python3 .ci/reap.py CMD [ARG...]``; exits with CMD's status.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
#: How long orphans still running when CMD ends (a server that outlived its test) may take to
#: exit before this gives up on them (they are left running, and their CPU uncounted).
LINGER_S = 30.0


def _reap(*, deadline: float) -> list[int]:
    """Reap every exited descendant until none is left or ``deadline``; the pids left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []
        if pid == 0:
            if time.monotonic() >= deadline:
                return _children()
            time.sleep(0.2)


def _children() -> list[int]:
    """This process's children still running (adopted orphans included)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == me:
                out.append(int(entry))
    return out


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("reap: not a subreaper here: orphans' CPU is not counted", file=sys.stderr)
    t0 = time.monotonic()
    rc = subprocess.call(sys.argv[1:])
    wall = time.monotonic() - t0
    left = _reap(deadline=time.monotonic() + LINGER_S)
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"== {' '.join(sys.argv[1:])}: {wall:.0f} s wall; CPU of everything it ran, orphans "
        f"included: {r.ru_utime:.1f} s user, {r.ru_stime:.1f} s system "
        f"({(r.ru_utime + r.ru_stime) / 60:.1f} CPU-min)",
        flush=True,
    )
    if left:
        print(f"== still running after {LINGER_S:.0f} s, not counted: pids {left}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
