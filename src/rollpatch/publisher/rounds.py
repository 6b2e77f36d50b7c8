"""Agreement between publisher ranks: which version to publish next, and where a run resumes.

Each rank's queue can coalesce differently (the ranks' trainers and uploads run at their own
pace), so before every version the ranks all-gather the versions they hold and publish the
oldest one they all hold; older ones are dropped everywhere. With one rank this reduces to
"publish the oldest pending snapshot".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..board import Board
from ..errors import BoardError, ConfigError, ManifestError, TrustError
from ..logs import Every
from ..manifest import Manifest
from ..types import MAX_VERSION
from .config import MAX_STATS, PublisherConfig
from .lease import Lease
from .sharded import Exchange

__all__ = [
    "DROP_LOG_S",
    "STALL_S",
    "Decision",
    "DropLog",
    "Pending",
    "Snapshot",
    "StallLog",
    "agree",
    "check_same_config",
    "next_version",
    "resume_point",
]

log = logging.getLogger("rollpatch.publisher")

#: Seconds between two log lines about versions dropped by coalescing (the first at once).
DROP_LOG_S = 60.0
#: Seconds a version may be in progress before a WARNING says so (then one per STALL_S).
STALL_S = 30.0


class DropLog:
    """Says that versions were dropped by coalescing (a newer one was waiting: the uplink is
    slower than the trainer): the first at once, then one line per :data:`DROP_LOG_S`."""

    def __init__(self, run: str, max_pending: int) -> None:
        self.run, self.max_pending = run, max_pending
        self._pace = Every(DROP_LOG_S)
        self._n_said = 0  # the drops counted at the last line

    def dropped(self, version: int, n_dropped: int) -> None:
        if not self._pace.due():
            return
        since, self._n_said = n_dropped - self._n_said, n_dropped
        log.info(
            "%s@%d: not published: a newer version was waiting (coalesced: %d version(s) "
            "since the last such line, %d in all; the uplink is slower than the trainer; "
            "stats.dropped lists them, max_pending=%d)",
            self.run,
            version,
            since,
            n_dropped,
            self.max_pending,
        )


class StallLog:
    """Says that the version being published has not become durable for :data:`STALL_S`:
    the store is slow or unreachable, while ``publish()`` goes on accepting (and coalescing)
    versions. Before, a frozen store showed nothing for minutes (an audit, session 40)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._pace = Every(STALL_S)

    def check(self, since: float | None, pending: int, dropped: int) -> None:
        """``since``: when the version in progress was taken up (None: none is)."""
        now = time.monotonic()
        if since is None or now - since < STALL_S or not self._pace.due():
            return
        log.warning(
            "%s: the version in progress is not durable after %.0f s (is the store slow or "
            "unreachable?); %d version(s) wait, %d coalesced in all",
            self.run,
            now - since,
            pending,
            dropped,
        )


@dataclass(eq=False)
class Snapshot:
    """Copies of one accepted state dict (numpy on the host, or torch on the masters' devices
    with ``diff_on="device"``), waiting to be published as ``version``."""

    version: int
    masters: dict[str, Any]
    t0: float
    snapshot_s: float
    step: int
    call_return_s: float | None = None
    #: Masters that are element ranges of larger tensors (``sharded_slices.SliceSpec``).
    slices: dict[str, Any] = field(default_factory=dict)
    #: A cast that failed in ``publish()`` (served snapshot): raised when the version is
    #: built, so every rank learns of it in the same round as before.
    error: BaseException | None = None


class Pending(deque[Snapshot]):
    """The snapshots waiting to be published, oldest first, at most ``max_pending`` once
    trimmed (a new one pushes the oldest out: coalescing), and the versions dropped that way
    (the most recent :data:`MAX_STATS`, and how many in all; :class:`DropLog` says so).
    Used under the publisher's lock."""

    def __init__(self, run: str, max_pending: int) -> None:
        super().__init__()
        self.max_pending = max_pending
        self.dropped: deque[int] = deque(maxlen=MAX_STATS)
        self.n_dropped = 0
        self._log = DropLog(run, max_pending)

    def put_back(self, snaps: list[Snapshot]) -> None:
        """``snaps`` (in version order) go back in front of the newer ones; then trimmed."""
        self.extendleft(reversed(snaps))
        self.trim()

    def trim(self) -> None:
        while len(self) > self.max_pending:
            self.drop(self.popleft().version)

    def drop(self, version: int) -> None:
        self.dropped.append(version)
        self.n_dropped += 1
        self._log.dropped(version, self.n_dropped)


@dataclass(frozen=True)
class Decision:
    """``publish`` ``version`` (with a keyframe if asked), ``wait`` until this rank holds
    ``version`` or newer, or ``exit`` (every rank closed with nothing left)."""

    action: str
    version: int | None = None
    keyframe: bool = False


def agree(
    x: Exchange, hand: list[Snapshot], *, closing: bool, keyframe: bool, sync: bool
) -> Decision:
    """Decide with the other ranks what to do with the snapshots in ``hand``.

    A collective: every rank calls it once per round. Raises :class:`BoardError` (on every
    rank alike) when the ranks' version sequences cannot be reconciled.
    """
    msgs = x.allgather(
        {
            "pending": [s.version for s in hand],
            "steps": [s.step for s in hand],
            "closing": closing,
            "keyframe": keyframe,
        }
    )
    sets = [set(m["pending"]) for m in msgs]
    common = set.intersection(*sets)
    if common:
        target = min(common)
        _check_steps(msgs, target)
        return Decision("publish", target, any(m["keyframe"] for m in msgs))
    union = set.union(*sets)
    if not union and all(m["closing"] for m in msgs):
        return Decision("exit")
    newest = max(union) if union else None
    stuck = [
        r
        for r, m in enumerate(msgs)
        if (sync or m["closing"])
        and (not m["pending"] or newest is None or max(m["pending"]) < newest)
    ]
    if stuck or sync:
        raise BoardError(
            "publisher ranks hold different versions: every rank must publish "
            "the same version numbers in the same order",
            pending={r: sorted(s) for r, s in enumerate(sets)},
            hint="call publish() (and close()) on every rank, with the same version= if given",
        )
    return Decision("wait", newest)


def _check_steps(msgs: list[dict[str, Any]], version: int) -> None:
    """Refuse (on every rank alike, before anything of ``version`` is written) a version
    whose shards the ranks took at different training steps: one rank skipped a
    ``publish()``, or ranks rebuilt their publishers after failures at different steps."""
    steps = {
        r: dict(zip(m["pending"], m["steps"]))[version]
        for r, m in enumerate(msgs)
        if isinstance(m.get("steps"), list) and len(m["steps"]) == len(m["pending"])
    }
    if len(set(steps.values())) > 1:
        raise BoardError(
            "publisher ranks hold different training steps for the same version: its "
            "shards would mix weights from different steps",
            version=version,
            steps=steps,
            hint="call publish() once per step on every rank, with the same version= and "
            "step=; after a failure, rebuild every rank's publisher at the same step",
        )


def check_same_config(x: Exchange, config: PublisherConfig, run: str) -> None:
    """Refuse ranks given different settings that must be equal on every rank
    (:meth:`PublisherConfig.shared_settings`), on every rank alike, before anything is read
    or written: rank 0 writes its own format, scales and keyframe list for every shard."""
    if x.size == 1:
        return
    mine = config.shared_settings()
    theirs: list[dict[str, Any]] = x.allgather(mine)
    differ = {
        k: {r: t.get(k) for r, t in enumerate(theirs)}
        for k in mine
        if any(t.get(k) != theirs[0].get(k) for t in theirs)
    }
    if differ:
        raise ConfigError(
            "publisher ranks were given different PublisherConfig settings: "
            + ", ".join(sorted(differ)),
            run=run,
            settings=differ,
            hint="give every rank the same PublisherConfig (only publisher_id, diff_on, "
            "snapshot, max_pending, outage_s, takeover and signer may differ)",
        )


def resume_point(
    board: Board, run: str, config: PublisherConfig, x: Exchange, lease: Lease | None = None
) -> tuple[int | None, str]:
    """Where publishing continues: the newest version on the board and its target digest.

    The ranks first compare their shared settings (:func:`check_same_config`); then rank 0
    takes (or keeps) the run's publisher ``lease`` (:mod:`.lease`).

    Rank 0 reads the board; a manifest newer than LATEST (a publisher died between writing
    it and advancing the pointer) is complete, so it re-puts it (restoring its keyframe marker)
    and rolls LATEST forward to it. Every rank gets the same answer.
    """
    check_same_config(x, config, run)
    message: dict[str, Any] = {}
    local: BaseException | None = None
    if x.rank == 0:
        try:
            if lease is not None:
                lease.acquire()
            message = _resume_point(board, run, config)
        except Exception as e:  # noqa: BLE001 (told to the other ranks, then re-raised)
            local, message = e, {"error": f"{type(e).__name__}: {e}"}
    answer = x.allgather(message)[0]
    if local is not None:
        raise local
    if "error" in answer:
        raise BoardError(f"cannot resume the run: {answer['error']}", run=run)
    return answer["top"], answer["target"]


def _reader(board: Board, config: PublisherConfig) -> Board:
    """The board as resuming reads it: a signing publisher builds only on manifests one of its
    own keys signed (anyone may write to the store)."""
    if config.signer is None:
        return board
    return Board(board.store, trust=config.signer.self_trust())


def _resume_point(board: Board, run: str, config: PublisherConfig) -> dict[str, Any]:
    try:
        pointer = board.latest(run)
    except ManifestError as e:  # not this run's LATEST (another run's copied in, garbage)
        if config.signer is None:
            raise
        log.warning("%s: LATEST is not this run's pointer (%s): it is replaced", run, e)
        pointer = None
    versions = board.versions(run)
    top, m = _own_top(board, run, config, versions)
    if pointer is not None and (top is None or pointer.version > top):
        if config.signer is None:
            raise BoardError(
                "LATEST names a version without a manifest",
                run=run,
                version=pointer.version,
                hint="someone moved LATEST past the manifests; a signing publisher replaces "
                "such a pointer (PublisherConfig.signer), an unsigned one cannot tell it "
                "from its own: restore the run's LATEST, or publish under a new run",
            )
        log.warning(
            "%s: LATEST names version %d, past every manifest this publisher signed: "
            "it is replaced",
            run,
            pointer.version,
        )
        pointer = None
    if top is None or m is None:
        return {"top": None, "target": ""}
    if m.format != config.format:
        raise ConfigError(
            "the run is published in another format",
            run=run,
            run_format=m.format,
            format=config.format,
            hint="use the run's format, or publish under a new run name",
        )
    if pointer is None or pointer.version < top:
        board.put_manifest(m)
        board.advance(run, top)
    return {"top": top, "target": m.target}


def _own_top(
    board: Board, run: str, config: PublisherConfig, versions: list[int]
) -> tuple[int | None, Manifest | None]:
    """The newest version to build on and its manifest. A signing publisher skips manifests
    none of its keys signed above the newest one they did sign (a squatted version number):
    it replaces them as it publishes (:meth:`~rollpatch.board.Board.put_manifest`), so they
    must not stop it from resuming. A run none of whose manifests it signed is someone
    else's (or unsigned): refused, never overwritten."""
    reader = _reader(board, config)
    skipped: list[tuple[int, TrustError]] = []
    for v in sorted(versions, reverse=True):
        try:
            m = reader.manifest(run, v)
        except TrustError as err:
            if config.signer is None:
                raise
            skipped.append((v, err))
            continue
        except ManifestError as err:  # its own signature, another run's or version's names
            if config.signer is None or skipped:  # (copied in: audit I, session 42)
                raise
            log.warning("%s@%d: not this version's manifest (%s): it is replaced", run, v, err)
            continue
        for s, why in skipped:
            log.warning(
                "%s@%d: a manifest none of this publisher's keys signed (%s): it is replaced",
                run,
                s,
                why.reason,
            )
        return v, m
    if skipped:  # not one version of the run is this publisher's
        last, why = skipped[-1]
        raise TrustError(
            f"no manifest of the run is signed by this publisher's keys ({why.message})",
            reason=why.reason,
            run=run,
            version=last,
            hint="sign with the key the run was published with, or publish under a new run",
        ) from None
    return None, None


def next_version(last: int | None, version: int | None, run: str) -> int:
    """The number of the version ``publish()`` is called for: ``version`` (a non-negative int
    above ``last``, the last one assigned), or the one after ``last`` (0 for the first)."""
    if version is None:
        n = 0 if last is None else last + 1
    else:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ConfigError("version must be a non-negative int", value=version)
        if last is not None and version <= last:
            raise ConfigError(
                "version numbers must increase", version=version, last_assigned=last, run=run
            )
        n = version
    if n > MAX_VERSION:
        raise ConfigError("version number too large", version=n)
    return n
