"""The publisher's signing chores: a start-up check of its keys against the board's root, and
re-signing LATEST while idle, so followers can tell alive from frozen (docs/trust.md).

A signed LATEST expires ``signer.latest_ttl_s`` after it was signed (docs/trust.md). Between
versions, a daemon thread re-signs the pointer for the version already there every
``ttl / 4`` (the board's compare-and-swap keeps it from ever moving LATEST back: when a newer
version landed meanwhile, the refresh leaves it alone).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..board import Board
from ..errors import ConfigError, RollpatchError, TrustError
from ..trust import Root, Signer, Trust, verify_initial_root

__all__ = [
    "LatestHeartbeat",
    "chained_trust",
    "check_clock",
    "check_signing",
    "fleet_refuses",
    "keys_short",
    "signing_board",
]

#: Seconds this host's clock may differ from the store's before a publisher says so.
CLOCK_SKEW_S = 60.0

log = logging.getLogger("rollpatch.publisher")


def fleet_refuses(board: Board, run: str, version: int) -> TrustError | None:
    """On a board with a root of trust: why a follower under the board's newest root could
    not reach ``version`` (the first manifest on the way to it that root does not accept: one
    signed only by a key a rotation retired), else None. None too when it cannot tell (no
    root, a root chain that does not verify): the board is untrusted, so this only decides
    whether a resuming publisher starts a new lineage, never whether it publishes."""
    try:
        trust = chained_trust(board)
        if trust is None:
            return None
        fleet = Board(board.store, trust=trust)
        plan = Board(board.store).plan(run, None, version)
    except RollpatchError as e:
        log.debug("%s: cannot tell what followers accept of the run: %s", run, e)
        return None
    for step in plan.steps:
        try:
            fleet.manifest(run, step.to)
        except TrustError as e:
            return e
        except RollpatchError:
            return None
    return None


def chained_trust(board: Board) -> Trust | None:
    """The board's roots walked from its first one (each verified by the one before), as a
    :class:`Trust` on the newest; None when the board has no root. Raises the chain's
    :class:`RollpatchError` when a root does not verify."""
    first = board.root_raw(1)
    if first is None:
        return None
    trust = Trust(first, follow_rotation=True)
    trust.update_root(board.root_raw)
    return trust


def keys_short(root: Root, signer: Signer | None) -> bool:
    """Whether ``signer``'s keys (None: no keys) fall short of ``root``'s threshold of the keys
    it lists (a root's followers would refuse what they sign)."""
    mine = set() if signer is None else {k.keyid for k in signer.keys} & set(root.keys)
    return len(mine) < root.threshold


def check_signing(board: Board, signer: Signer | None) -> None:
    """At start: refuse keys (or no keys) that the board's verified newest root does not list
    in threshold (followers would refuse every version, and a signing
    publisher would replace the run's valid ones as if squatted; found by an audit, session
    38); else warn when what is about to be published will not verify (a newest root that
    does not chain from the first one, an expired root, no root while signing).
    """
    try:  # the chained newest root: one a rotation by the key holders made
        trust = chained_trust(board)
        root = None if trust is None else trust.root
    except RollpatchError as e:  # not chained: what any writer of the board could put there
        log.debug("the board's roots do not chain from its first: %s", e)
        root = _newest_root(board)
        if root is None:
            return
        _warn_unlisted(root, signer)
        return
    if root is None:
        if signer is not None:
            log.warning(
                "signing, but the board has no root of trust yet: followers need one "
                "(`rollpatch root`) to verify"
            )
        return
    if keys_short(root, signer):
        if signer is None:
            raise ConfigError(
                f"publishing UNSIGNED to a board with a root of trust (version {root.version}):"
                " followers with --trust would refuse every version; not publishing",
                hint="pass --signing-key (PublisherConfig(signer=...)) with a key the root "
                "lists; docs/trust.md",
            )
        raise ConfigError(
            f"the board's root of trust (version {root.version}) does not list this "
            "publisher's signing keys in threshold (retired by a rotation?): followers would "
            "refuse what it publishes, and it would replace the run's valid versions; not "
            "publishing",
            hint="sign with the keys the newest root lists (`rollpatch status --trust` names "
            "them); docs/trust.md, Rotating keys",
        )
    if root.expired(time.time()):
        log.warning(
            "the board's root of trust (version %d) has expired: followers with --trust "
            "refuse everything until a new root is published (`rollpatch root`)",
            root.version,
        )


def _newest_root(board: Board) -> Root | None:
    """The board's newest root, verified by its own keys only (None: none, or unreadable)."""
    try:
        roots = board.roots()
        raw = board.root_raw(roots[-1]) if roots else None
        return None if raw is None else verify_initial_root(raw)
    except RollpatchError as e:
        log.warning("cannot read the board's root of trust: %s", e)
        return None


def _warn_unlisted(root: Root, signer: Signer | None) -> None:
    """Warn that followers under ``root`` will refuse what this publisher signs (a root that
    does not chain from the first one: only a warning, it may be anyone's)."""
    mine = set() if signer is None else {k.keyid for k in signer.keys} & set(root.keys)
    if len(mine) < root.threshold:
        log.warning(
            "the board's newest root of trust (version %d, not chained from its first) lists "
            "%d of this publisher's keys, %d are needed: followers under it refuse what it "
            "publishes",
            root.version,
            len(mine),
            root.threshold,
        )


class LatestHeartbeat:
    """Re-signs LATEST of ``run`` for ``version()`` every ``period_s`` until :meth:`stop`."""

    def __init__(
        self, board: Board, run: str, version: Callable[[], int | None], period_s: float
    ) -> None:
        self.board, self.run, self.version, self.period_s = board, run, version, period_s
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"rollpatch-heartbeat-{run}"
        )
        self._thread.start()

    def beat(self) -> None:
        """Re-sign LATEST now (if the publisher has a durable version)."""
        n = self.version()
        if n is None:
            return
        self.board.advance(self.run, n, refresh=True)
        self.beats += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
            except RollpatchError as e:  # the store is down: try again next period
                log.warning("%s: re-signing LATEST failed: %s", self.run, e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)


def signing_board(board: Board | str, signer: Signer | None) -> Board:
    """The board a publisher writes through: ``board`` (or a store URI), seen through its own
    signer's view of the store when it signs (the caller's ``board`` is not changed)."""
    b = board if isinstance(board, Board) else Board(board)
    if signer is not None and b.signer is not signer:
        b = Board(b.store, signer=signer)
    return b


def check_clock(board: Board, key: str, wrote_at: float, ttl_s: float) -> float | None:
    """The store's clock against this host's: the object ``key`` was written at ``wrote_at``
    (``time.time()`` here); its ``modified`` time is the store's. A difference beyond
    :data:`CLOCK_SKEW_S` is warned of: a signed LATEST's ``issued``/``expires`` are this
    host's times, so followers refuse it as expired early (a clock behind) or keep a frozen
    one alive late (ahead); before session 38 a clock 2 h behind published LATESTs the whole
    fleet refused with a hint about a dead publisher. Returns the difference (None: the
    store keeps no write times). Stores of this host's own files agree by construction."""
    try:
        info = board.store.head(key)
    except RollpatchError:
        return None
    if info is None or info.modified is None:
        return None
    skew = wrote_at - info.modified
    if abs(skew) > CLOCK_SKEW_S:
        log.warning(
            "this host's clock is %.0f s %s the store's: a signed LATEST (valid %.0f s) "
            "%s; fix the clock (NTP)",
            abs(skew),
            "behind" if skew < 0 else "ahead of",
            ttl_s,
            "is refused as expired early by followers"
            if skew < 0
            else "stays valid late when the publisher stops",
        )
    return skew
