"""Follower vocabulary: its states, its configuration and the status it reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import partial

from ..validate import check_int, check_number

__all__ = ["FollowerConfig", "FollowerState", "FollowerStatus"]


class FollowerState(enum.Enum):
    """Where the follower is: IDLE → FETCHING → STAGING → COMMITTING → IDLE, or ERROR."""

    IDLE = "idle"
    FETCHING = "fetching"
    STAGING = "staging"
    COMMITTING = "committing"
    ERROR = "error"


_number = partial(check_number, "FollowerConfig")
_integer = partial(check_int, "FollowerConfig")


@dataclass(frozen=True, kw_only=True)
class FollowerConfig:
    """How a follower polls, fetches and what it accepts. Every field is validated."""

    #: Seconds between two reads of LATEST in the background loop (> 0).
    poll_s: float = 0.5
    #: Objects fetched concurrently (1..256).
    fetch_workers: int = 4
    #: Extra attempts per object or board read after the first (0..100); a transient store
    #: failure, a missing object or a corrupt object (hash mismatch) is retried.
    retries: int = 3
    #: First wait before a retry, in seconds; doubles on every further attempt (>= 0).
    backoff_s: float = 0.2
    #: Seconds one object may take to arrive and verify, all retries included (> 0).
    timeout_s: float = 60.0
    #: Refuse plans that would fetch more than this many bytes (None: no limit).
    max_stage_bytes: int | None = None
    #: Background audit (follower/audit.py): live bytes re-hashed per second while the engine
    #: serves (None: no audit). The whole model is covered every model bytes / rate seconds.
    audit_bytes_per_s: float | None = 64 * 2**20
    #: Seconds between two audit slices (> 0); a slice hashes rate × period bytes.
    audit_period_s: float = 1.0

    def __post_init__(self) -> None:
        _number("poll_s", self.poll_s, 0.0, 86400.0, lo_open=True)
        _integer("fetch_workers", self.fetch_workers, 1, 256)
        _integer("retries", self.retries, 0, 100)
        _number("backoff_s", self.backoff_s, 0.0, 3600.0)
        _number("timeout_s", self.timeout_s, 0.0, 86400.0, lo_open=True)
        if self.max_stage_bytes is not None:
            _integer("max_stage_bytes", self.max_stage_bytes, 1, 1 << 60)
        if self.audit_bytes_per_s is not None:
            _number("audit_bytes_per_s", self.audit_bytes_per_s, 0.0, 1e13, lo_open=True)
        _number("audit_period_s", self.audit_period_s, 0.0, 3600.0, lo_open=True)


@dataclass(frozen=True)
class FollowerStatus:
    """A snapshot of a follower.

    ``version`` is the version the engine holds *and* the follower has verified against the
    board (None while unknown: before the first sync, or after the engine's bits were found
    not to match any version). ``lag`` is ``latest - version`` when both are known.
    ``last_error`` (``"ClassName: message"``) and ``error_type`` describe the most recent
    failure and are cleared by the next successful sync. Counters are cumulative; the
    ``*_s`` timings are of the most recent sync that got that far (``last_commit_s`` is the
    engine pause as the commit gate measured it: the one pause figure; ``last_stage_s`` the
    staging done while the engine served). ``audits`` counts audit mismatches.
    """

    state: FollowerState
    version: int | None
    latest: int | None
    lag: int | None
    last_error: str | None
    error_type: str | None
    bytes_fetched: int
    objects_fetched: int
    commits: int
    reboots: int
    retries: int
    last_commit_s: float | None
    last_fetch_s: float | None
    last_stage_s: float | None
    audits: int = 0
