"""Publishing one agreed version across the ranks (the :class:`Publisher`'s worker calls it).

Each rank builds its shard (cast, diff, encode, upload), the ranks exchange the results, rank
0 writes the manifest and advances LATEST, every rank learns the outcome and commits its shard
state, and the version's :class:`VersionStats` are measured. Which version, and when, is the
:class:`~rollpatch.publisher.core.Publisher`'s business; how it lands on the board is here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ..board import Board, version_key
from ..errors import BoardError, ConfigError, NoPathError, ObjectIntegrityError, TrustError
from ..logs import Every, event
from ..view import View
from .assemble import assemble_manifest
from .config import PublisherConfig, VersionStats
from .keyframe import reconstruct_shard, shard_matches
from .lease import Lease
from .pipeline import ShardPipeline
from .reconstruct import reconstruct
from .result import ShardResult
from .rounds import Snapshot, resume_point
from .sharded import Exchange
from .signing import check_clock, fleet_refuses

__all__ = ["VersionWriter"]

log = logging.getLogger("rollpatch.publisher")

#: A step patch above this share of the served view is warned about: RL steps give 0.1-3 %
#: of the view; a patch this large means most served values changed (another model of the
#: same shape published into the run, or a learning rate far above RL's).
LARGE_STEP = 0.25
#: Seconds between two such warnings (the ones between are counted on the next).
LARGE_STEP_LOG_S = 60.0


class VersionWriter:
    """This rank's side of publishing versions: its shard pipeline (host or device), the
    roots of recent versions (for skip patches) and the resume from the board's newest one."""

    def __init__(
        self,
        board: Board,
        run: str,
        config: PublisherConfig,
        x: Exchange,
        resume_from: int | None,
        resume_target: str,
        lease: Lease | None = None,
    ) -> None:
        self.board, self.run, self.config, self._x = board, run, config, x
        self.lease = lease  # rank 0's hold on the run (checked before each manifest)
        self.resume_from = resume_from
        self.roots: dict[int, str] = {} if resume_from is None else {resume_from: resume_target}
        self.pipe = ShardPipeline(board, run, config, x.rank)
        #: The diff runs on the masters' devices (None: ``diff_on="auto"``, not decided yet).
        self.on_device: bool | None = {"host": False, "device": True}.get(config.diff_on)
        if self.on_device:
            self.pipe = _device_pipeline(board, run, config, x.rank)
        #: How the last resume rebuilt this rank's base: "shard" (its own objects only),
        #: "whole" (every shard), or None (no resume yet).
        self.resume_scope: str | None = None
        #: Rank 0: the sliced layout of the last version (None: read from the parent).
        self._layout: dict[str, tuple[object, ...]] | None = None
        self._clock_checked = False  # rank 0, signing: this host's clock against the store's
        self._large = Every(LARGE_STEP_LOG_S)  # the large-step warning (an audit)
        #: Rank 0: the last version whose manifest it wrote and LATEST names (known durable
        #: even when the outcome exchange after it fails).
        self.durable: int | None = None

    @classmethod
    def open(cls, board: Board, run: str, config: PublisherConfig, x: Exchange) -> VersionWriter:
        """A new publisher's writer: rank 0 takes the run's lease (renewed from now on until
        released), and every rank resumes from the board's newest version."""
        lease = None
        if x.rank == 0:
            lease = Lease(board.store, run, config.publisher_id, takeover=config.takeover)
        try:
            top, target = resume_point(board, run, config, x, lease)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if lease is not None:
            lease.start()
            if getattr(board.store, "created", False):  # a new board, a typo, a missing mount
                log.info(
                    "board %s did not exist: created it; run %r starts there", board.store.uri, run
                )
        return cls(board, run, config, x, top, target, lease)

    def restarted(self) -> tuple[int | None, VersionWriter]:
        """A writer resuming from the board's newest version (after a store outage:
        ``publisher/outage.py``), with this one's lease, choice of device and clock check,
        and that version."""
        top, target = resume_point(self.board, self.run, self.config, self._x, self.lease)
        w = VersionWriter(self.board, self.run, self.config, self._x, top, target, self.lease)
        if self.on_device is not None and w.on_device is None:  # diff_on="auto", decided
            w.on_device = self.on_device
            if self.on_device:
                w.pipe = _device_pipeline(self.board, self.run, self.config, self._x.rank)
        w._clock_checked = self._clock_checked
        return top, w

    def decide_device(self, state_dict: Mapping[str, Any]) -> bool:
        """Where the diff runs; ``diff_on="auto"``: the first state dict decides."""
        if self.on_device is None:
            self.on_device = any(
                type(v).__module__.startswith("torch") and v.device.type != "cpu"
                for v in state_dict.values()
            )
            if self.on_device:
                self.pipe = _device_pipeline(self.board, self.run, self.config, self._x.rank)
        return self.on_device

    def publish(
        self, snap: Snapshot, parent: int | None, forced_keyframe: bool, started: float
    ) -> VersionStats:
        """Publish ``snap`` on top of ``parent`` (every rank calls this for the same version);
        raises this rank's error, or :class:`BoardError` naming another rank's."""
        n, k = snap.version, self.config.keyframe_every
        keyframe = forced_keyframe or parent is None or (k > 0 and n // k != parent // k)
        resume_s = 0.0
        res: ShardResult | None = None
        local: BaseException | None = None
        try:
            if self.resume_from is not None and self.pipe.prev is None:
                t = time.perf_counter()
                base = self._resumed_view(snap)
                resume_s = time.perf_counter() - t
                if base is None:  # no sound path to it: this version is a fresh keyframe
                    parent, keyframe = None, True
                else:
                    self.pipe.resume(self.resume_from, base, sharded=self._x.size > 1)
            if snap.error is not None:
                raise snap.error
            self.pipe.slices = snap.slices
            res = self.pipe.build(n, snap.masters, keyframe=keyframe)
            message: dict[str, Any] = res.message()
        except Exception as e:  # noqa: BLE001 (told to the other ranks, then re-raised)
            local, message = e, {"ok": False, "error": f"{type(e).__name__}: {e}"}
        t_commit = time.perf_counter()
        messages = self._x.allgather(message)
        outcome: dict[str, Any] = {}
        if self._x.rank == 0:
            outcome, err = self._write_manifest(snap, parent, keyframe, messages)
            local = local or err
            if outcome.get("ok"):
                self.durable = n
        try:
            outcome = self._x.allgather(outcome)[0]
        except BoardError as e:
            if self.durable != n:
                raise
            raise BoardError(
                f"a publisher rank stopped answering once version {n} was written: its "
                "manifest is durable and LATEST names it (the other ranks may not know)",
                hint="restart every rank; the publisher resumes after this version",
                **{**e.context, "run": self.run, "version": n},
            ) from e
        if local is not None:
            raise local
        if not outcome.get("ok"):
            raise BoardError(
                f"publishing failed on another rank: {outcome.get('error')}",
                run=self.run,
                version=n,
            )
        assert res is not None
        stats = self._record(snap, res, parent, started, resume_s, t_commit, outcome)
        self.pipe.commit(res)  # after the stats: total_s ends when LATEST names the version
        if self._x.rank == 0:  # one line per version LATEST names (rank 0's share if sharded)
            event(
                log,
                "version_published",
                run=self.run,
                version=n,
                parent=parent,
                keyframe=stats.keyframe,
                skip_bases=",".join(map(str, stats.skip_bases)) or None,
                patch_bytes=stats.patch_bytes,
                bytes=stats.bytes,
                changed=stats.changed,
                encode_s=round(stats.encode_s, 3),
                total_s=round(stats.total_s, 3),
            )
        return stats

    def _resumed_view(self, snap: Snapshot) -> View | None:
        """The resumed version's view as this rank's base: its own shard only when the board
        has it in the same layout (``keyframe.reconstruct_shard``), else the whole view.

        None when an unsharded publisher finds no sound path to it (objects corrupt on the
        store, with no way around: an attacker or a bad disk can do that, and a publisher
        that could not resume would never publish again; or, for a signing publisher, a way
        through a manifest none of its keys signed, as after a key rotation); the version
        then starts a new lineage from a keyframe (``parent`` None). Ranks of a sharded publisher must agree
        on that, which they have no round for: they raise instead."""
        assert self.resume_from is not None
        signer = self.config.signer
        trust = None if signer is None else signer.self_trust()
        if self._x.size > 1:
            part = reconstruct_shard(
                self.board, self.run, self.resume_from, self._x.rank, self._x.size, trust=trust
            )
            if (
                part is not None
                and shard_matches(part, snap.masters, self.config.format)
                and all(part[k].shape == s.local_shape for k, s in snap.slices.items())
            ):
                self.resume_scope = "shard"
                return part
        if signer is not None and self._x.size == 1:
            why = fleet_refuses(self.board, self.run, self.resume_from)
            if why is not None:  # built on, the version would reach only followers already there
                log.warning(
                    "%s: the way to version %d passes a manifest the board's trust root no "
                    "longer accepts (%s); version %d is published as a keyframe with no "
                    "parent, which followers under that root can boot from",
                    self.run,
                    self.resume_from,
                    why.message,
                    snap.version,
                )
                self.resume_scope = "keyframe"
                return None
        self.resume_scope = "whole"
        try:
            return reconstruct(self.board, self.run, self.resume_from, trust=trust)
        except (ObjectIntegrityError, NoPathError, TrustError) as e:
            # TrustError: the way to it passes a manifest none of this publisher's keys
            # signed (a keyframe signed only by a key a rotation retired)
            if self._x.size > 1:
                raise
            log.warning(
                "%s: cannot rebuild version %d from sound objects%s (%s: %s); version %d is "
                "published as a keyframe with no parent",
                self.run,
                self.resume_from,
                "" if signer is None else " signed by this publisher's keys",
                type(e).__name__,
                e,
                snap.version,
            )
            self.resume_scope = "keyframe"
            return None

    def _write_manifest(
        self, snap: Snapshot, parent: int | None, keyframe: bool, messages: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], BaseException | None]:
        bad = [(r, m) for r, m in enumerate(messages) if not m.get("ok")]
        if bad:
            return {"ok": False, "error": f"rank {bad[0][0]}: {bad[0][1].get('error')}"}, None
        try:
            if self.lease is not None:
                self.lease.check()
            meta = {"step": str(snap.step), "scales": self.config.scales}
            if self._layout is None and parent is not None:
                pm = self.board.manifest(self.run, parent)
                self._layout = {t.name: t.layout() for t in pm.sliced}
            m = assemble_manifest(
                run=self.run,
                version=snap.version,
                parent=parent,
                keyframe=keyframe,
                messages=messages,
                root_digests=self.roots,
                config=self.config,
                meta=meta,
                layout=self._layout,
            )
            wrote_at = time.time()
            self.board.put_manifest(m)
            now_at = self.board.advance(self.run, snap.version)
            if now_at.version > snap.version:  # not ours: this publisher holds the run
                raise BoardError(
                    f"LATEST names version {now_at.version}, ahead of this publisher's "
                    f"{snap.version}, and signed as this publisher signs: another publisher "
                    "on the run, or manifests copied in from another board or run signed "
                    "with the same key (followers took it)",
                    run=self.run,
                    version=snap.version,
                    hint="one signing key per board (docs/trust.md); remove what was copied "
                    "in and restart the publisher, or publish under a new run name",
                )
            self._layout = {t.name: t.layout() for t in m.sliced}
            if self.config.signer is not None and not self._clock_checked:  # once, signed
                self._clock_checked = True
                ttl = self.config.signer.latest_ttl_s
                check_clock(self.board, version_key(self.run, snap.version), wrote_at, ttl)
        except Exception as e:  # noqa: BLE001 (told to the other ranks, then re-raised)
            return {"ok": False, "error": f"rank 0: {type(e).__name__}: {e}"}, e
        skip_bases = sorted({p.base for p in m.patches} - {parent})
        return {
            "ok": True,
            "target": m.target,
            "skip_bases": skip_bases,
            "keyframe": m.is_keyframe,
        }, None

    def _record(
        self,
        snap: Snapshot,
        res: ShardResult,
        parent: int | None,
        started: float,
        resume_s: float,
        t_commit: float,
        outcome: dict[str, Any],
    ) -> VersionStats:
        now = time.perf_counter()
        n = snap.version
        self.roots[n] = outcome["target"]
        horizon = n - self.config.window  # the oldest base a skip or folded patch may need
        for v in [v for v in self.roots if v < horizon]:
            del self.roots[v]
        if parent is not None and (res.dropped or res.whole):
            log.warning(
                "%s@%d: %d tensor(s) added, reshaped or retyped and %d dropped since version "
                "%d: engines started with the previous model cannot load it (they keep "
                "serving their version; docs/follower.md)",
                self.run,
                n,
                res.whole,
                res.dropped,
                parent,
            )
        sharded = self._x.size > 1  # (an empty shard's patch header is all of it)
        large = parent is not None and res.patch_bytes > LARGE_STEP * max(res.view.nbytes, 1)
        now = time.monotonic()
        if large and not (sharded and res.view.nbytes == 0) and self._large.due():
            held = self._large.said_held
            log.warning(
                "%s@%d: the step patch from version %d is %.0f%% of %s (%d values "
                "changed; RL steps give 0.1-3%%): another model of the same shape, or a "
                "learning rate far above RL's? It is exact either way, only large%s",
                self.run,
                n,
                parent,
                100 * res.patch_bytes / max(res.view.nbytes, 1),
                "this rank's shard" if sharded else "the served view",
                res.changed,
                f" ({held} more such version(s) since the last line)" if held else "",
            )
        return VersionStats(
            version=n,
            parent=parent,
            keyframe=bool(outcome["keyframe"]),
            skip_bases=tuple(outcome["skip_bases"]),
            snapshot_s=snap.snapshot_s,
            call_return_s=snap.call_return_s if snap.call_return_s is not None else now - snap.t0,
            queue_s=max(0.0, started - snap.t0 - snap.snapshot_s),
            resume_s=resume_s,
            commit_s=now - t_commit,
            total_s=now - snap.t0,
            bytes=res.bytes,
            patch_bytes=res.patch_bytes,
            changed=res.changed,
            tensors_dropped=res.dropped,
            tensors_whole=res.whole,
            host_bytes=res.host_bytes,
            **{k: res.timings.get(k, 0.0) for k in ("cast_s", "diff_s", "encode_s", "upload_s")},
        )


def _device_pipeline(board: Board, run: str, config: PublisherConfig, shard: int) -> ShardPipeline:
    try:
        from .devpipe import DeviceShardPipeline
    except ImportError as e:
        raise ConfigError(
            "PublisherConfig(diff_on='device') needs torch",
            hint="pip install 'rollpatch[torch]', or use diff_on='host'",
        ) from e
    return DeviceShardPipeline(board, run, config, shard)
