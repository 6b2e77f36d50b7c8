"""Follower vocabulary: its states, its configuration and the status it reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from ..config import check_fields, setting

__all__ = ["BootMode", "FollowerConfig", "FollowerState", "FollowerStatus"]

#: How an engine with no verified version starts (docs/follower.md, *Adopting a booted
#: engine*): ``keyframe`` fetches the run's keyframe; ``adopt`` first looks for a published
#: version whose target is the digest of the words the engine booted with.
BootMode = Literal["keyframe", "adopt"]


class FollowerState(enum.Enum):
    """Where the follower is: IDLE → FETCHING → STAGING → COMMITTING → IDLE, or ERROR."""

    IDLE = "idle"
    FETCHING = "fetching"
    STAGING = "staging"
    COMMITTING = "committing"
    ERROR = "error"


@dataclass(frozen=True, kw_only=True)
class FollowerConfig:
    """How a follower polls, fetches and what it accepts. Every field is validated."""

    poll_s: float = setting(
        0.5, lo=0.0, lo_open=True, hi=86400.0, help="seconds between LATEST polls"
    )
    fetch_workers: int = setting(
        4, lo=1, hi=256, flag="--workers", help="objects fetched concurrently"
    )
    #: A transient store failure, a missing object or a corrupt object (hash mismatch) is
    #: retried.
    retries: int = setting(
        3, lo=0, hi=100, help="extra attempts per object or board read after the first"
    )
    backoff_s: float = setting(
        0.2,
        lo=0.0,
        hi=3600.0,
        help="seconds before the first retry; doubles on every further attempt",
    )
    timeout_s: float = setting(
        60.0,
        lo=0.0,
        lo_open=True,
        hi=86400.0,
        help="seconds one object may take to arrive and verify, all retries included",
    )
    push_bytes: int = setting(
        64 * 2**20,
        lo=0,
        hi=256 * 2**20,
        help="through a relay, accept up to this many bytes of a new version's manifest and "
        "step patch in the long-poll answer that announces it (0: fetch them after it)",
    )
    """Bytes of the announced version's manifest and step patch objects the follower's
    long-poll of LATEST accepts in the answer (docs/relay.md, "Push"): the follower then reads
    LATEST, the manifest and the objects from that answer instead of three more requests;
    they are checked exactly as fetched ones (signatures, BLAKE3). Held until read or the next
    answer, so at most this many bytes (plus LATEST) are kept."""
    max_stage_bytes: int | None = setting(
        None, lo=1, hi=1 << 60, help="refuse plans that would fetch more bytes than this"
    )
    #: Background audit (follower/audit.py); the whole model is covered every model bytes /
    #: rate seconds.
    audit_bytes_per_s: float | None = setting(
        64 * 2**20,
        lo=0.0,
        lo_open=True,
        hi=1e13,
        flag="--audit-bytes-per-s",
        help="live bytes re-hashed per second while the engine serves",
    )
    audit_period_s: float = setting(
        1.0,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="seconds between two audit slices (a slice hashes rate x period bytes)",
    )

    boot: BootMode = setting(
        "keyframe",
        help="how an engine with no version starts: keyframe (fetch one), or adopt (take the "
        "published version its words hash to, if any, then catch up by patches; a checksum "
        "match: only for checkpoints you trust)",
    )
    adopt_scan: int = setting(
        32,
        lo=1,
        hi=4096,
        help="with --boot adopt: the newest versions checked (then the keyframes and the "
        "first version)",
    )
    #: An island that holds nothing serves an older version rather than none (a corrupt
    #: object on the way to the one it wants); a one-shot pull wants exactly that one.
    fallback_older: bool = setting(
        True,
        help="with nothing held and the wanted version unreachable (a corrupt object on the "
        "way), take the newest of the 4 earlier versions that can be reached",
    )

    def __post_init__(self) -> None:
        check_fields(self)


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
    staging done while the engine served). ``audits`` counts audit mismatches, ``failures``
    failed syncs (each retry of the background loop that failed counts).
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
    failures: int = 0
    #: Versions taken over from the words the engine booted with (``boot="adopt"``).
    adoptions: int = 0
    #: Seconds since the follower last read LATEST from the board (None: never).
    latest_age_s: float | None = None
    #: The failure of the last board read that was retried (``"ClassName: message"``;
    #: cleared by a successful sync): why a first read of LATEST is still in progress.
    last_retry_error: str | None = None
    #: The ``created`` time (Unix seconds, the publisher's clock) of the manifest of the last
    #: version committed (None: none committed since start): how old the served policy is.
    served_created: float | None = None
