"""Adopting the version an engine booted with, instead of fetching a keyframe.

An engine started from a checkpoint of a published version (a vLLM or SGLang server, or the
built-in engine, booted from ``rollpatch pull``'s output or the run's base model) already
holds that version's words. With ``FollowerConfig.boot="adopt"``, a follower whose engine
has no version hashes the engine's words once (:meth:`EngineAdapter.boot_digest`, fresh, at
memory speed inside the engine), looks for a published version whose target root is that
digest — the newest ``adopt_scan`` versions up to LATEST, then the run's keyframes and its
first version, newest first — and, if one matches, has the engine adopt it (:meth:`EngineAdapter.adopt`
hashes again and takes it only if the words still match). It then catches up by patches
from there. No match, an engine that cannot hash its words, or any failure: the usual boot
from a keyframe.

One attempt per stretch without a verified version (:meth:`Adopter.reset` after every
sync that ends on one): an engine whose words are no published version is hashed once, not
on every retry; an engine that could not hash (not up yet) is asked again at the next sync. The match is by root digest — with format 2 the ``rp.sum128`` checksum
(docs/patch-format.md §7.1), which catches faults, not forgery: adopt only checkpoints you
trust (docs/follower.md, *Adopting a booted engine*).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ..board import Board
from ..engines import EngineAdapter
from ..engines.restarts import RESTARTED
from ..engines.staged import AuditReport
from ..errors import RollpatchError
from ..manifest import Manifest
from .config import FollowerConfig
from .record import Record

__all__ = ["Adopter", "candidates"]

log = logging.getLogger("rollpatch.follower")


def candidates(
    versions: Sequence[int], keyframes: Sequence[int], scan: int, upto: int | None = None
) -> list[int]:
    """The versions an adoption checks, in order: the newest ``scan`` published up to
    ``upto`` (LATEST: a manifest above it is not yet a version the run names), then the
    keyframes (newest first) and the first version, each once; at most ``2 * scan + 1``."""
    listed = {v for v in versions if upto is None or v <= upto}
    newest = sorted(listed, reverse=True)[:scan]
    seen = set(newest)
    out = list(newest)
    extra = [k for k in sorted(keyframes, reverse=True) if k in listed][:scan]
    if listed:
        extra.append(min(listed))
    for n in extra:
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


class Adopter:
    """Adopts the published version an engine with no version holds (see the module)."""

    def __init__(
        self,
        engine: EngineAdapter,
        reader: Board,
        run: str,
        manifest: Callable[[int], Manifest],
        rec: Record,
        *,
        scan: int,
    ) -> None:
        self._engine, self._reader, self._run = engine, reader, run
        self._manifest, self._rec, self._scan = manifest, rec, scan
        self._tried = False

    @classmethod
    def configured(
        cls,
        engine: EngineAdapter,
        reader: Board,
        run: str,
        manifest: Callable[[int], Manifest],
        rec: Record,
        config: FollowerConfig,
    ) -> Adopter | None:
        """The adopter ``config`` asks for (``boot="adopt"``), else None."""
        if config.boot != "adopt":
            return None
        return cls(engine, reader, run, manifest, rec, scan=config.adopt_scan)

    def reset(self) -> None:
        """The engine holds a verified version: the next loss of it gets one attempt."""
        self._tried = False

    def audit_found(self, report: AuditReport) -> None:
        """An audit found live words that differ from the held version: no attempt until the
        engine holds a verified version again (it is re-synced from a keyframe), unless the
        engine restarted (its boot checkpoint's words, which it may adopt). Words an audit
        found are no checkpoint's, and what an adoption hashes may not be all the kernels
        serve: a CPU-packed expert copy, found only by the audit, was adopted over and over
        (found by an audit, session 39)."""
        if set(report.mismatched) - {RESTARTED}:
            self._tried = True

    def attempt(self, want: int, latest: int | None) -> bool:
        """Whether the engine now holds a version by adoption (at most LATEST, or ``want``
        if higher: a manifest above both is not yet a version the run names); False: boot
        from a keyframe."""
        upto = want if latest is None else max(want, latest)
        return self._adopt(upto) is not None

    def _adopt(self, upto: int) -> int | None:
        if self._tried:
            return None
        t0 = time.monotonic()
        try:
            digest = self._engine.boot_digest()
        except RollpatchError as e:  # not an answer (an engine not up yet): asked again next sync
            log.warning("%s: could not hash the engine's words to adopt them: %s", self._run, e)
            return None
        if digest is None:
            self._tried = True
            log.info(
                "%s: engine %s cannot hash its words; no adoption", self._run, self._engine.name
            )
            return None
        hashed_s = time.monotonic() - t0
        order = candidates(  # a store failure here fails the sync; the next one tries again
            self._reader.versions(self._run), self._reader.keyframes(self._run), self._scan, upto
        )
        self._tried = True
        for n in order:
            try:
                target = self._manifest(n).target
            except RollpatchError as e:  # gone meanwhile, or refused: not this one
                log.debug("%s@%d: manifest not usable for adoption: %s", self._run, n, e)
                continue
            if target != digest:
                continue
            try:
                self._engine.adopt(n, digest)
            except RollpatchError as e:
                log.warning("%s@%d: adoption refused: %s", self._run, n, e)
                return None
            self._rec.count(adoptions=1)
            log.info(
                "%s@%d: adopted the engine's words (root %s, hashed in %.3f s; %.3f s in all): "
                "no keyframe fetched",
                self._run,
                n,
                digest[:16],
                hashed_s,
                time.monotonic() - t0,
            )
            return n
        log.info(
            "%s: the engine's words (root %s) are none of the %d versions checked; booting "
            "from a keyframe",
            self._run,
            digest[:16],
            len(order),
        )
        return None
