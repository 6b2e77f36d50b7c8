"""The background audit: live weights re-hashed at a bounded rate while the engine serves.

A commit proves its writes in O(changed) (staging) and reads the written positions back
under the pause; neither sees a word that changes where no patch wrote (a flipped bit, a
stray write). The auditor closes that gap: every ``period_s`` it asks the engine to re-hash
the next ``rate × period`` bytes of its live tensors (round-robin, so the whole model is
covered every ``model bytes / rate`` seconds) against the digests of the version it holds.
On a mismatch the engine reports no version (the sidecar's ``/ready`` answers 503, so a
gateway takes it out of rotation), and the follower re-syncs from a keyframe by itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..engines.base import EngineAdapter
from ..engines.staged import AuditReport
from ..errors import EngineUnreachableError, RollpatchError
from .commit import CommitGate
from .config import FollowerConfig
from .failures import FailureLog

__all__ = ["Auditor"]

#: Seconds before the same audit failure is logged again.
AUDIT_LOG_S = 60.0

log = logging.getLogger("rollpatch.follower")


class Auditor:
    """Runs :meth:`EngineAdapter.audit` every ``period_s`` with ``rate × period_s`` bytes.

    ``on_mismatch(report)`` is called (on the auditor's thread) when live words differ.
    Counters: ``slices`` (answered), ``passes`` (full rounds), ``bytes`` (hashed),
    ``mismatches``;
    ``bytes_at_first_mismatch``: ``bytes`` when the first mismatch was found (how much was
    hashed before finding it, however late someone looks).
    """

    def __init__(
        self,
        engine: EngineAdapter,
        *,
        rate_bytes_per_s: float,
        period_s: float,
        on_mismatch: Callable[[AuditReport], None],
        busy: Callable[[], bool] = lambda: False,
        on_contact: Callable[[bool], None] = lambda answered: None,
        on_taken: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        #: Called with True when the engine answered a slice (its identity checked: a remote
        #: engine that restarted is found so), False when it could not be reached.
        self.on_contact = on_contact
        #: Called when the engine refused a slice because another adapter drives it.
        self.on_taken = on_taken
        #: 0 (rate 0): a heartbeat, nothing hashed; the call still renews the adapter's hold
        #: on the engine and checks its identity (:mod:`rollpatch.engines.ownership`).
        self.budget = 0 if rate_bytes_per_s <= 0 else max(1, int(rate_bytes_per_s * period_s))
        self.period_s = period_s
        self.on_mismatch = on_mismatch
        self.busy = busy
        self.slices = 0
        self.passes = 0
        self.bytes = 0
        self.mismatches = 0
        self.bytes_at_first_mismatch: int | None = None
        self.last: AuditReport | None = None
        self._since: float | None = None  # when the slice in progress was asked for
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def configured(
        cls,
        engine: EngineAdapter,
        config: FollowerConfig,
        gate: CommitGate,
        *,
        on_mismatch: Callable[[AuditReport], None],
    ) -> Auditor:
        """The auditor ``config`` asks for, skipping slices while ``gate`` runs a weight
        change and telling it whether the engine answered (:meth:`CommitGate.contact`).
        With ``audit_bytes_per_s`` unset it hashes nothing but still calls every period (a
        heartbeat): an idle adapter with no audit made no call between commits, so another
        sidecar took its engine over after the ownership lease and it went on labelling the
        other one's weights (an audit, session 40); the call also finds a restarted engine."""
        rate = config.audit_bytes_per_s
        return cls(
            engine,
            rate_bytes_per_s=0.0 if rate is None else rate,
            period_s=config.audit_period_s,
            on_mismatch=on_mismatch,
            busy=lambda: gate.busy,  # a weight change runs: not now
            on_contact=gate.contact,
            on_taken=gate.taken,
        )

    def step(self) -> AuditReport | None:
        """One slice now (None: the engine cannot audit, or holds no version to audit)."""
        if self.engine.version is None or self.busy():
            return None
        self._since = time.monotonic()
        try:
            report = self.engine.audit(self.budget)
        finally:
            self._since = None
        if report is None:
            return None
        if not report.mismatched:  # it answered, with the words it should hold
            self.on_contact(True)
        self.last = report
        self.slices += 1
        self.bytes += report.nbytes
        self.passes += report.wrapped
        if report.mismatched:
            self.mismatches += 1
            if self.bytes_at_first_mismatch is None:
                self.bytes_at_first_mismatch = self.bytes
            log.warning(
                "audit: live weights differ from the held version (%s); out of "
                "rotation until re-synced",
                ", ".join(report.mismatched[:3]),
            )
            self.on_mismatch(report)
        return report

    def waiting_s(self) -> float:
        """Seconds the slice in progress has waited for the engine's answer (0: none)."""
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rollpatch-audit")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        failures = FailureLog(log, "audit", what="audit", level=logging.INFO, repeat_s=AUDIT_LOG_S)
        while not self._stop.wait(self.period_s):
            try:
                self.step()
                failures.cleared()
            except RollpatchError as e:  # the engine is unreachable or busy: try next period
                if isinstance(e, EngineUnreachableError):
                    self.on_contact(False)
                elif e.context.get("other_adapter"):
                    self.on_taken()
                failures.failed(e)  # the same failure once a minute, not every period
