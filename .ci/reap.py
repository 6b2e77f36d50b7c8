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


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("reap: not a subreaper here: orphans' CPU is not counted", file=sys.stderr)
    t0 = time.monotonic()
    rc = subprocess.call(sys.argv[1:])
    wall = time.monotonic() - t0
    while True:  # orphans still running (a server that outlived its test): reap them too
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"== {' '.join(sys.argv[1:])}: {wall:.0f} s wall; CPU of everything it ran, orphans "
        f"included: {r.ru_utime:.1f} s user, {r.ru_stime:.1f} s system "
        f"({(r.ru_utime + r.ru_stime) / 60:.1f} CPU-min)",
        flush=True,
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
