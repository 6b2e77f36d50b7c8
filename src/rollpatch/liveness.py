"""Whether a process named by a token still runs: tokens for one-writer leases.

A token (:func:`process_token`) is random, then, where ``/proc`` tells them, the kernel's boot
id, the PID namespace, the pid and the start time of the process it was made in. Another
process on the same kernel and in the same PID namespace can then tell (:func:`token_gone`)
that the token's process no longer runs — killed with no chance to let go of what it held
(``kill -9``) — when that pid no longer exists, is a zombie, or is another process's (its start
time differs). Anywhere else (another container's PID namespace, another host) nothing can be
told from a pid, and :func:`token_gone` says False: the holder's lease must run out instead.

Used by the engines' ownership (one sidecar per engine) and the publisher's lease (one
publisher per run).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["process_token", "token_gone"]


def process_token() -> str:
    """A new token for this process (random, then where it runs when ``/proc`` says)."""
    token = secrets.token_hex(8)
    here = _where()
    return token if here is None else f"{token}.{here[0]}.{here[1]}.{os.getpid()}.{here[2]}"


def _where() -> tuple[str, str, str] | None:
    """This process's boot id, PID namespace and start time (clock ticks since boot)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
        ns = os.readlink("/proc/self/ns/pid")
        start = _stat(str(os.getpid()))
    except (OSError, ValueError):
        return None
    ns = "".join(c for c in ns if c.isdigit())
    if not (boot.isalnum() and ns and start is not None):
        return None
    return boot, ns, start[1]


def _stat(pid: str) -> tuple[str, str] | None:
    """Process ``pid``'s state letter and start time from ``/proc/PID/stat``; None: no such
    process. The name (field 2) may hold spaces and parentheses: fields after the last ')'."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    return rest[0], rest[19]


def token_gone(token: str) -> bool:
    """Whether ``token`` names a process of this kernel and PID namespace that no longer runs
    (False whenever that cannot be told)."""
    parts = token.split(".")
    here = _where()
    if len(parts) != 5 or here is None or tuple(parts[1:3]) != here[:2]:
        return False
    pid, start = parts[3], parts[4]
    if not (pid.isdigit() and start.isdigit()):
        return False
    try:
        now = _stat(pid)
    except (OSError, ValueError, IndexError):
        return False
    return now is None or now[0] in ("Z", "X") or now[1] != start
