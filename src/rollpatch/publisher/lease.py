"""One publisher per run: the run's publisher lease (``runs/{run}/PUBLISHER``, docs/board.md).

Two publishers on one run (a job restarted while the old one still runs, two trainers given
one run name) race for every version: before session 41 the loser found out only when a
version's manifest was already there, and stopped naming both (an audit, session 40). Now
rank 0 of each publisher holds the run's lease:

- **At start** (inside the resume, before anything of the run is read or written) it reads
  the lease. Absent, released, expired (by the holder's clock), or held by a process of this
  kernel that no longer runs (:mod:`rollpatch.liveness`: ``kill -9``) → it takes it (a
  compare-and-swap). Held by another live publisher → :class:`ConfigError` (exit 2 in the
  CLI) naming it, unless ``takeover=True``.
- **While it runs** it renews the lease every :data:`RENEW_S` (a thread), each time a
  compare-and-swap against its own last write: a renewal that finds another publisher's
  lease means the run was taken over, and the publisher stops before its next manifest
  (:class:`ConflictError` naming the other). A store outage only delays renewals.
- **close()** releases it, so the next publisher starts at once.

The lease is not signed and proves nothing to followers (they never read it): whoever can
write the board can block a publisher's start with a forged lease (``takeover=True`` gets past
it) — such a writer could as well delete the board.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from .. import jsonsafe
from ..errors import BoardError, ConfigError, ConflictError, NotFoundError, StoreError
from ..layout import publisher_lease_key
from ..liveness import process_token, token_gone
from ..logs import Every, event
from ..store import Store

__all__ = ["LEASE_S", "RENEW_S", "Holder", "Lease"]

log = logging.getLogger("rollpatch.publisher")

LEASE_SCHEMA = "rollpatch.publisher-lease/1"
#: Seconds a lease holds after its last renewal (what a publisher killed on another host
#: keeps the run for).
LEASE_S = 60.0
#: Seconds between two renewals.
RENEW_S = 15.0
#: A lease is a few hundred bytes; more is not one.
MAX_LEASE_BYTES = 4096
_clock = time.time  # wall clock: other hosts read the times (tests set their own here)
#: Tokens of this process's leases that were let go (a store outage may have kept the release
#: from being written): a publisher this process starts next takes them at once.
_let_go: set[str] = set()


@dataclass(frozen=True)
class Holder:
    """What a lease says: who holds it, and until when (the holder's wall clock)."""

    publisher: str
    token: str
    renewed: float
    expires: float
    released: bool = False

    def encode(self) -> bytes:
        doc = {
            "schema": LEASE_SCHEMA,
            "publisher": self.publisher,
            "token": self.token,
            "renewed": round(self.renewed, 3),
            "expires": round(self.expires, 3),
            "released": self.released,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def parse_holder(raw: bytes) -> Holder | None:
    """The lease in ``raw``; None when it is not one (a free lease, said by the caller)."""
    try:
        doc = jsonsafe.loads(raw, what="publisher lease", error=BoardError, max_depth=2)
    except BoardError:
        return None
    if not isinstance(doc, dict) or doc.get("schema") != LEASE_SCHEMA:
        return None
    pub, token, renewed, expires = (
        doc.get(k) for k in ("publisher", "token", "renewed", "expires")
    )
    released = doc.get("released", False)
    if not (isinstance(pub, str) and isinstance(token, str) and len(pub) + len(token) < 1024):
        return None
    times = [t for t in (renewed, expires) if isinstance(t, (int, float))]
    if len(times) != 2 or any(isinstance(t, bool) for t in times) or not isinstance(released, bool):
        return None
    return Holder(pub, token, float(times[0]), float(times[1]), released)


class Lease:
    """Rank 0's hold on ``run`` (see the module's docstring); ``publisher``: its id."""

    def __init__(self, store: Store, run: str, publisher: str, *, takeover: bool) -> None:
        self.store, self.run, self.publisher, self.takeover = store, run, publisher, takeover
        self.key = publisher_lease_key(run)
        self.token = process_token()
        self._mine: bytes | None = None  # our last write (None: not held)
        #: The publisher that took the run over (None: not taken).
        self.lost_to: Holder | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unrenewed = Every(60.0)  # the line that says a renewal failed

    def acquire(self) -> None:
        """Take the lease (or renew it, when this publisher holds it: after a store outage).

        Raises :class:`ConfigError` while another live publisher holds it (``takeover``
        False), :class:`ConflictError` when another took it from this one."""
        with self._lock:
            for _ in range(8):  # lost compare-and-swap races: read again
                raw = self._read()
                cur = None if raw is None else parse_holder(raw)
                ours = cur is not None and cur.token == self.token and not cur.released
                if self._mine is not None and not ours:
                    self.lost_to = cur or Holder("(unreadable lease)", "", 0.0, 0.0)
                    raise self.taken_over()
                why = "" if ours else self._free(cur, raw)
                if why is None:
                    assert cur is not None
                    if not self.takeover:
                        raise self._held_by(cur)
                    why = f"takeover=True (publisher {cur.publisher!r} held it)"
                try:
                    self._write(expected=raw)
                except ConflictError:
                    continue
                if why:
                    event(log, "lease_taken", logging.WARNING, run=self.run, why=why)
                return
        raise ConflictError("the run's publisher lease kept moving", run=self.run, key=self.key)

    def start(self) -> None:
        """Renew the lease every :data:`RENEW_S` until :meth:`release`."""
        self._thread = threading.Thread(
            target=self._renew_loop, daemon=True, name=f"rollpatch-lease-{self.run}"
        )
        self._thread.start()

    def check(self) -> None:
        """Before a version's manifest: renew the lease (one compare-and-swap), and raise
        when another publisher took the run over (a store failure is raised as it is)."""
        with self._lock:
            if self.lost_to is None and self._mine is not None:
                try:
                    self._write(expected=self._mine)
                except ConflictError:
                    self._lost()
        if self.lost_to is not None:
            raise self.taken_over()

    def release(self) -> None:
        """Stop renewing and let the next publisher start at once."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if len(_let_go) > 10_000:
            _let_go.clear()
        _let_go.add(self.token)
        with self._lock:
            if self._mine is None or self.lost_to is not None:
                return
            now = _clock()
            try:
                self.store.cas(
                    self.key,
                    Holder(self.publisher, self.token, now, now, released=True).encode(),
                    expected=self._mine,
                )
            except StoreError as e:  # it runs out by itself
                event(log, "lease_not_released", run=self.run, error=str(e))
            self._mine = None

    def taken_over(self) -> ConflictError:
        other = self.lost_to
        return ConflictError(
            f"the run was taken over by publisher {other.publisher if other else '?'!r} "
            f"(this publisher is {self.publisher}); it stopped before its next version",
            run=self.run,
            hint="one publisher per run: a takeover (PublisherConfig.takeover) stops the one "
            "before",
        )

    # -- internals ------------------------------------------------------------------------

    def _read(self) -> bytes | None:
        try:
            return self.store.get(self.key, max_bytes=MAX_LEASE_BYTES)
        except NotFoundError:
            return None

    def _write(self, *, expected: bytes | None) -> None:
        now = _clock()
        data = Holder(self.publisher, self.token, now, now + LEASE_S).encode()
        self.store.cas(self.key, data, expected=expected)
        self._mine = data

    def _free(self, cur: Holder | None, raw: bytes | None) -> str | None:
        """Why the lease may be taken ("" nobody held it), or None: another holds it."""
        if raw is None or (cur is not None and cur.released):
            return ""
        if cur is None:
            return "the lease there is not one (unreadable): replaced"
        now = _clock()
        if now >= cur.expires:
            return f"publisher {cur.publisher!r}'s lease ran out {now - cur.expires:.0f} s ago"
        if token_gone(cur.token):
            return f"publisher {cur.publisher!r} no longer runs (its process is gone)"
        if cur.token in _let_go:
            return f"publisher {cur.publisher!r} of this process stopped"
        return None

    def _held_by(self, cur: Holder) -> ConfigError:
        now = _clock()
        return ConfigError(
            f"run {self.run!r} is being published by {cur.publisher!r} (its lease was renewed "
            f"{max(0.0, now - cur.renewed):.0f} s ago and holds {max(0.0, cur.expires - now):.0f} s "
            "more, by its host's clock): two publishers on one run race for every version",
            run=self.run,
            hint="stop the other publisher first (a stopped one lets go at once, a killed one "
            f"within {LEASE_S:g} s); to take the run over now: PublisherConfig(takeover=True), "
            "rollpatch publish --takeover",
        )

    def _lost(self) -> None:
        """A renewal found another lease: who holds it now (under the lock)."""
        try:
            raw = self._read()
        except StoreError:
            raw = None
        cur = None if raw is None else parse_holder(raw)
        self.lost_to = cur or Holder("(unreadable lease)", "", 0.0, 0.0)
        event(log, "lease_lost", logging.ERROR, run=self.run, error=str(self.taken_over()))

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S):
            self.renew()

    def renew(self) -> None:
        """One renewal (the thread's); says a takeover or a failure, never raises."""
        with self._lock:
            if self._mine is None or self.lost_to is not None:
                return
            try:
                self._write(expected=self._mine)
            except ConflictError:
                self._lost()
            except StoreError as e:  # an outage: the next renewal (or the resume) tries again
                if self._unrenewed.due():
                    event(log, "lease_not_renewed", logging.WARNING, run=self.run, error=str(e))
