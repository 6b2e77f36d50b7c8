"""The :class:`Publisher`: snapshots master weights and publishes them as versions.

Threading model: ``publish()`` copies the state dict to host memory and returns; one worker
thread takes snapshots in version order and runs the pipeline (cast, diff, encode, upload,
manifest, LATEST). The queue holds at most ``max_pending`` waiting snapshots; a new one pushes
out the oldest waiting one. Sharded publishers agree on each version with their peers before
publishing it (docs/publisher.md, "Sharding protocol").
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any

from ..board import Board
from ..errors import ConfigError
from ..types import check_run
from .cast import CastView, HostSnapshots
from .config import MAX_STATS, PublisherConfig, PublisherStats, VersionStats
from .exiting import Ending, close_at_exit, close_exchange
from .guards import diverged, engine_names, note_names
from .outage import Outage, is_outage
from .rounds import Pending, Snapshot, StallLog, agree, next_version
from .sharded import open_exchange
from .signing import LatestHeartbeat, check_signing, signing_board
from .snapshot import snapshot_masters, snapshot_state
from .wordpool import WordPool
from .writer import VersionWriter

__all__ = ["Publisher", "snapshot_state"]


#: Seconds after LATEST names a version until the worker composes its step into the skip
#: accumulators (or the next build does, if sooner): work for later skip patches, kept out of
#: the moments when readers decode the version, maybe on the same cores (docs/publisher.md).
SETTLE_AFTER_S = 0.5


class Publisher(Ending):
    """Publishes a run's versions to a board, in the background by default.

    ``board``: a :class:`Board` or a store URI. ``asynchronous=False`` publishes inside
    ``publish()``. Sharding (one shard per rank: disjoint tensor names or element ranges,
    FSDP2 ``DTensor`` shards along dim 0 or :class:`~rollpatch.publisher.TensorSlice` values)
    is on when ``group`` is given or torch.distributed runs more than one rank, unless
    ``sharded=False``; every rank then constructs the publisher and publishes the same
    versions in the same order, and ``collective_timeout_s`` bounds the wait for a hung rank
    (None: gloo's 30 minutes; more than the longest gap between two publishes). On a run
    with versions it resumes after the newest one (docs/publisher.md).
    """

    def __init__(
        self,
        board: Board | str,
        run: str,
        config: PublisherConfig | None = None,
        *,
        asynchronous: bool = True,
        group: Any = None,
        sharded: bool | None = None,
        collective_timeout_s: float | None = None,
    ) -> None:
        self.config = config if config is not None else PublisherConfig()
        if not isinstance(self.config, PublisherConfig):
            raise ConfigError("config must be a PublisherConfig")
        self.board = signing_board(board, self.config.signer)
        self.run = check_run(run)
        self._x = open_exchange(group, sharded, collective_timeout_s)
        if self._x.rank == 0:  # before the resume, which may replace what it cannot verify
            check_signing(self.board, self.config.signer)
        self._cond = threading.Condition()
        self._pending = Pending(self.run, self.config.max_pending)
        self._busy = False
        self._closing = self._closed = self._aborted = False
        self._error: BaseException | None = None
        self._error_reported = False
        self._kf_requested = self._kf_consumed = 0
        self._stats: deque[VersionStats] = deque(maxlen=MAX_STATS)
        self._published = self._bytes = 0
        self._names_noted = False
        self._stall_log = StallLog(self.run)
        self._outage = Outage(self.run, self.config.outage_s, self._cond)
        self._busy_since: float | None = None  # the worker's round in progress, since when
        self._writer = VersionWriter.open(self.board, self.run, self.config, self._x)
        if self._writer.lease is not None:  # a publisher dropped without close() lets go too
            weakref.finalize(self, self._writer.lease.release)
        self._last_assigned = self._last_durable = self._writer.resume_from
        # the host snapshot's words, reused once free (paged in): the base and the next
        # snapshot, and the anchor's view the host path folds from
        self._words = WordPool(per_name=2 + (self.config.fold_every > 0))
        self._snaps = HostSnapshots(self._words)
        self._heartbeat: LatestHeartbeat | None = None
        signer = self.config.signer
        if signer is not None and self._x.rank == 0:
            self._heartbeat = LatestHeartbeat(
                self.board, self.run, lambda: self.last_durable, signer.latest_ttl_s / 4
            )
        self._worker: threading.Thread | None = None
        #: When the worker composes what the last commit left (None: nothing left).
        self._settle_at: float | None = None
        if asynchronous:
            self._worker = threading.Thread(
                target=self._work, daemon=True, name=f"rollpatch-publisher-{self.run}"
            )
            self._worker.start()
            close_at_exit(self)

    # -- public API --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This publisher's shard index (0 when unsharded)."""
        return self._x.rank

    @property
    def resume_scope(self) -> str | None:
        """How the last resume rebuilt this rank's base: "shard" (its own objects only),
        "whole" (every shard), "keyframe" (no sound path to the resumed version: the next
        version was published as a keyframe with no parent), or None (no resume yet)."""
        return self._writer.resume_scope

    @property
    def shards(self) -> int:
        """How many ranks publish shards of each version (1 when unsharded)."""
        return self._x.size

    @property
    def last_durable(self) -> int | None:
        """The newest version this publisher knows is durable and named by LATEST (after a
        resume: the version it resumed from)."""
        with self._cond:
            return self._last_durable

    @property
    def stats(self) -> PublisherStats:
        """Per-version timings and bytes, dropped versions (a consistent snapshot)."""
        with self._cond:
            return PublisherStats(
                tuple(self._stats),
                self._bytes,
                tuple(sorted(self._pending.dropped)),
                self._pending.n_dropped,
                self._published,
                self._outage.ridden,
                self._outage.elapsed(),
            )

    def publish(
        self, state_dict: Mapping[str, Any], version: int | None = None, *, step: int | None = None
    ) -> int:
        """Snapshot ``state_dict`` and publish it as the next version; returns its number.

        The caller may change its tensors as soon as this returns. ``version`` (default: one
        more than the last assigned) must exceed every version assigned so far. ``step`` is
        recorded in the manifest's meta (default: the version number).
        """
        t0 = time.perf_counter()
        self._check_usable()
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ConfigError("step must be a non-negative int (the trainer's step)", value=step)
        if self.config.names == "unwrap":
            state_dict, taken, aliases = engine_names(state_dict)
            if not self._names_noted:
                self._names_noted = True
                note_names(self.run, taken, aliases)
        masters, slices, cast_error = snapshot_masters(
            state_dict, self.config, self._snaps, self._decide_device, sharded=self._x.size > 1
        )
        snap_s = time.perf_counter() - t0
        # a step that fails anyway (NaN) must not push the last good one out of the queue
        refuse = self.config.nonfinite == "refuse"
        keep = len(self._pending) >= self.config.max_pending and diverged(
            masters, cast_error, refuse=refuse
        )
        with self._cond:
            self._check_usable()
            n = self._assign(version)
            snap = Snapshot(n, masters, t0, snap_s, step if step is not None else n, None, slices)
            snap.error = cast_error
            if self._worker is None:
                self._busy = True
            else:
                snap.call_return_s = time.perf_counter() - t0
                self._pending.append(snap)
                if not keep:
                    self._pending.trim()
                self._stall_log.check(self._busy_since, len(self._pending), self._pending.n_dropped)
                self._cond.notify_all()
        if self._worker is None:
            try:
                self._round([snap], closing=False, sync=True)
            except BaseException as e:
                self._fail(e)
                self._error_reported = True
                raise
            finally:
                with self._cond:
                    self._busy = False
        return n

    def publish_keyframe(self) -> None:
        """Give the next published version a keyframe too (on every rank if any asks)."""
        with self._cond:
            self._kf_requested += 1

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every accepted snapshot is durable (or dropped) and LATEST advanced.

        Raises the worker's first error, or :class:`TimeoutError` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._busy) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"publisher flush timed out after {timeout} s "
                        f"({len(self._pending)} snapshot(s) pending)"
                    )
                self._cond.wait(left)
            self._raise_error()

    # close(), abort(), __exit__: .exiting.Ending

    def __enter__(self) -> Publisher:  # noqa: PYI034 (typing.Self needs 3.11)
        return self

    # -- internals ---------------------------------------------------------------------------

    def _check_usable(self) -> None:
        with self._cond:
            if self._closed or self._closing:
                raise ConfigError("the publisher is closed", run=self.run)
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            self._error_reported = True
            raise self._error

    def _assign(self, version: int | None) -> int:
        self._last_assigned = next_version(self._last_assigned, version, self.run)
        return self._last_assigned

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = e
            self._pending.clear()
            self._cond.notify_all()
        # a failed publisher never writes a version again: the run is free for a new one at
        # once (a trainer that drops it and starts another need not close it first; its
        # heartbeat, if signing, goes on re-signing LATEST until close)
        if self._writer.lease is not None:
            self._writer.lease.release()

    def _work(self) -> None:
        try:
            self._rounds()
        finally:
            if self._aborted:  # abort() left the exchange to this thread: no round runs now
                close_exchange(self._x)

    def _rounds(self) -> None:
        waiting_for: int | None = None
        done = False
        while not done:
            settle = False
            with self._cond:
                while not (
                    self._closing
                    or (
                        self._pending
                        and (waiting_for is None or self._pending[-1].version >= waiting_for)
                    )
                ):
                    left = None if self._settle_at is None else self._settle_at - time.monotonic()
                    if left is not None and left <= 0:
                        settle, self._settle_at = True, None
                        break
                    self._cond.wait(left)
                if self._aborted:  # no round: the other ranks may never join it
                    return
            if settle:  # SETTLE_AFTER_S passed with no new version: compose the last step
                try:
                    self._writer.pipe.settle()
                except BaseException as e:  # noqa: BLE001 (kept; raised by flush/publish/close)
                    self._fail(e)
                    done = True
                continue
            with self._cond:
                if self._x.size == 1:
                    hand = [self._pending.popleft()] if self._pending else []
                else:
                    hand = list(self._pending)
                    self._pending.clear()
                self._busy, self._busy_since = True, time.monotonic() if hand else None
                closing = self._closing
            try:
                done, waiting_for = self._round(hand, closing=closing, sync=False)
            except BaseException as e:  # noqa: BLE001 (kept; raised by flush/publish/close)
                self._fail(e)  # before busy clears, so a waiting flush() sees the error
                done = True
            finally:
                with self._cond:
                    if self._writer.pipe.unsettled and self._settle_at is None:
                        self._settle_at = time.monotonic() + SETTLE_AFTER_S
                    self._busy, self._busy_since = False, None
                    self._cond.notify_all()

    def _round(self, hand: list[Snapshot], *, closing: bool, sync: bool) -> tuple[bool, int | None]:
        """Agree with the other ranks on a version from ``hand`` and publish it.

        Returns (worker done, version to wait for before the next round).
        """
        with self._cond:
            kf_seq = self._kf_requested
            kf = kf_seq > self._kf_consumed
        decision = agree(self._x, hand, closing=closing, keyframe=kf, sync=sync)
        if decision.action == "exit":
            return True, None
        if decision.action == "wait":
            with self._cond:
                self._pending.put_back(hand)
            return False, decision.version
        target = decision.version
        assert target is not None
        snap = next(s for s in hand if s.version == target)
        with self._cond:
            for s in hand:
                if s.version < target:
                    self._pending.drop(s.version)
            self._pending.put_back([s for s in hand if s.version > target])
        try:
            self._publish(snap, decision.keyframe)
        except BaseException as e:  # noqa: BLE001 (a store outage is ridden out)
            return self._ride_out(e, snap, sync=sync)
        if decision.keyframe:
            with self._cond:
                self._kf_consumed = max(self._kf_consumed, kf_seq)
        return False, None

    def _ride_out(
        self, error: BaseException, snap: Snapshot, *, sync: bool
    ) -> tuple[bool, int | None]:
        """After ``error`` failed ``snap``: re-raise it, or, for a store outage within
        ``outage_s`` (unsharded), wait until the board answers, resume from its LATEST
        (:mod:`.outage`) and publish ``snap`` again (``sync``) or queue it again, where a
        newer snapshot may replace it (unless the resumed version is it or newer)."""
        if not is_outage(error) or self._x.size > 1:
            raise error
        top, writer = self._outage.ride(
            error, snap.version, self._writer.restarted, closing=lambda: self._closing
        )
        with self._cond:  # (the lease: nobody else published past what this one assigned)
            self._writer, self._last_durable = writer, top
            if top is not None and snap.version <= top:
                return False, None
            if not sync:
                self._pending.put_back([snap])
                return False, None
        return self._round([snap], closing=False, sync=True)

    def _decide_device(self, local: Mapping[str, Any]) -> bool:
        with self._cond:
            return self._writer.decide_device(local)

    def _publish(self, snap: Snapshot, forced_keyframe: bool) -> None:
        self._writer.pipe.settle_later = self._worker is not None  # see SETTLE_AFTER_S
        try:
            stats = self._writer.publish(
                snap, self._last_durable, forced_keyframe, started=time.perf_counter()
            )
        except BaseException:
            if self._writer.durable == snap.version:  # rank 0: LATEST names it anyway
                with self._cond:
                    self._last_durable = snap.version
            raise
        with self._cond:
            self._last_durable = snap.version
            self._published += 1
            self._bytes += stats.bytes
            self._stats.append(stats)
            self._outage.ended()
            self._cond.notify_all()
        if isinstance(snap.masters, CastView):
            snap.masters.step = None  # the cast's changes, if the pipeline did not take them
        snap.masters = {}  # free the host copy early
