"""The verifier side: a trusted root (kept current by rotation) and rollback state.

One :class:`Trust` per service (follower, sidecar, relay, ``pull``). It answers three
questions, each with a :class:`~rollpatch.errors.TrustError` whose ``reason`` names the attack:

- is this envelope signed by ``threshold`` keys of the current root? (``unsigned``,
  ``bad_signature``; ``root`` when the root itself expired or a new one does not chain);
- is this LATEST still fresh? (``expired``: a frozen pointer);
- is it at least the highest LATEST verified before, across restarts? (``rollback``).

It does no I/O of its own but its state file; newer roots come from a callable the board (or
the relay) supplies. Thread-safe.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import blake3

from ..errors import ConfigError, RollpatchError, TrustError
from ..logs import Throttle
from .envelope import Envelope, verify_threshold
from .root import MAX_ROOT_BYTES, Root, verify_initial_root, verify_next_root
from .state import TrustState

__all__ = ["Trust", "default_state_path", "warn_unverified"]

log = logging.getLogger("rollpatch.trust")

#: Roots one update may walk (a board with more rotations than this is hostile).
MAX_ROOT_STEPS = 1024


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_unverified(service: str) -> None:
    """Say once per service and process that signatures are not being verified."""
    with _warned_lock:
        if service in _warned:
            return
        _warned.add(service)
    log.warning(
        "rollpatch %s: verification is OFF (no trust root): unsigned or forged "
        "manifests and LATEST are accepted; pass --trust ROOT to verify",
        service,
    )


def default_state_path(root_raw: bytes, board: str) -> Path:
    """``$XDG_STATE_HOME/rollpatch/trust-<id>.json`` (default ``~/.local/state``), one file per
    (trust root, board) pair, so two boards or two roots never share rollback state."""
    import os

    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    ident = hashlib.sha256(root_raw + b"\0" + board.encode("utf-8", "replace")).hexdigest()
    return Path(base) / "rollpatch" / f"trust-{ident[:24]}.json"


class Trust:
    """A trust root (envelope bytes of a root document) and where to keep rollback state.

    ``state_path`` None keeps the state in memory only (no protection across restarts).
    ``root_check_s`` is how often :meth:`roots_due` says to look for a rotated root;
    ``follow_rotation`` False keeps the given root for good (never reads newer ones).
    """

    def __init__(
        self,
        root: bytes,
        *,
        state_path: str | Path | None = None,
        root_check_s: float = 30.0,
        follow_rotation: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.root_check_s = root_check_s
        self.follow_rotation = follow_rotation
        # a str is a path too (it failed mid-sync, when the state was first saved)
        self.state_path = None if state_path is None else Path(state_path)
        state_path = self.state_path
        initial = verify_initial_root(root)
        self._anchor = initial
        self._root, self._root_raw = initial, root
        self._verified: dict[int, str] = {initial.version: blake3.blake3(root).hexdigest()}
        self._state = TrustState() if state_path is None else TrustState.load(state_path)
        #: Saves of the state the disk refused (:meth:`_save`).
        self.save_errors = 0
        self._said = Throttle(log, every_s=60.0)
        if self._state.root is not None:
            self._adopt_stored_root(self._state.root)
        self._next_check = 0.0
        #: The last walk met a next root that does not chain (None: it did not): every
        #: document is refused with it until a walk finds none or a sound one.
        self._blocked: TrustError | None = None

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        state_path: str | Path | None = None,
        board: str | None = None,
        root_check_s: float = 30.0,
    ) -> Trust:
        """The trust root in ``path``; the state file defaults to :func:`default_state_path`
        of (root, ``board``) when ``board`` is given."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_ROOT_BYTES + 1)
        except OSError as e:
            raise ConfigError(
                f"cannot read the trust root: {e.strerror or e}", path=str(path)
            ) from None
        if len(raw) > MAX_ROOT_BYTES:
            raise ConfigError("the trust root file is too large", path=str(path))
        if state_path is None and board is not None:
            state_path = default_state_path(raw, board)
        try:
            return cls(raw.strip(), state_path=state_path, root_check_s=root_check_s)
        except TrustError as e:
            raise ConfigError(
                f"the trust root is not a valid signed root: {e.message}",
                path=str(path),
                hint="use the root.json that `rollpatch root` wrote",
            ) from None

    def _adopt_stored_root(self, raw: bytes) -> None:
        try:
            stored = verify_initial_root(raw)
        except TrustError as e:
            raise ConfigError(
                f"trust state holds an invalid root: {e.message}", path=str(self.state_path)
            ) from None
        anchor = self._anchor
        if stored.version < anchor.version:
            return
        if stored.version == anchor.version and raw != self._root_raw:
            raise ConfigError(
                "trust state belongs to another trust root",
                path=str(self.state_path),
                hint="use another --trust-state file for this root",
            )
        self._root, self._root_raw = stored, raw
        self._verified[stored.version] = blake3.blake3(raw).hexdigest()

    # -- the root -----------------------------------------------------------------------------

    @property
    def root(self) -> Root:
        return self._root

    def verified_root(self, version: int) -> str | None:
        """BLAKE3 (hex) of root ``version``'s envelope if this verifier verified it."""
        with self._lock:
            return self._verified.get(version)

    def roots_due(self) -> bool:
        """Whether it is time to look for a rotated root (every ``root_check_s``)."""
        return self.follow_rotation and self._clock() >= self._next_check

    def update_root(self, fetch: Callable[[int], bytes | None]) -> Root:
        """Walk roots ``current+1, current+2, ...`` that ``fetch`` returns (None: no such
        root yet), verifying each against the one before; persist the newest."""
        with self._lock:
            self._next_check = self._clock() + self.root_check_s
            root, raw = self._root, self._root_raw
        if not self.follow_rotation:
            return root
        changed = False
        for _ in range(MAX_ROOT_STEPS):
            nxt = fetch(root.version + 1)
            if nxt is None:
                break
            try:
                root, raw = verify_next_root(root, nxt), nxt
            except TrustError as e:  # the board's rotation, or the operator's trust file?
                err = _other_board(root, fetch) or _unchained(root, e)
                with self._lock:  # nothing is accepted past it, not only until the next sync
                    self._blocked = err  # (before session 42 the next document passed: audit I)
                raise err from None
            changed = True
            with self._lock:
                self._verified[root.version] = blake3.blake3(raw).hexdigest()
            log.info(
                "trust root rotated to version %d (%d keys, threshold %d)",
                root.version,
                len(root.keys),
                root.threshold,
            )
        with self._lock:
            self._blocked = None
        if changed:
            with self._lock:
                if root.version > self._root.version:
                    self._root, self._root_raw = root, raw
                    self._state.root = raw
                    self._save()
        return self._root

    # -- documents ----------------------------------------------------------------------------

    def verify(self, env: Envelope, **context: object) -> None:
        """TrustError unless ``env`` carries ``threshold`` valid signatures of the current
        root's keys and that root has not expired."""
        blocked = self._blocked
        if blocked is not None:  # a next root that does not chain: as if updates were withheld
            raise TrustError(blocked.message, hint=blocked.hint, **blocked.context)
        root = self._root
        if root.expired(self._clock()):
            raise TrustError(
                "the trust root has expired",
                reason="root",
                root_version=root.version,
                hint="publish a new root (`rollpatch root`) signed by the keys",
            )
        verify_threshold(env, root.keys, root.threshold, **context)

    def check_latest(self, run: str, version: int, expires: float) -> None:
        """Refuse an expired (frozen) LATEST or one older than the highest verified; record
        ``version`` as the highest (persisted) when it is."""
        now = self._clock()
        if now > expires:
            raise TrustError(
                "LATEST has expired (a frozen or stale pointer)",
                reason="expired",
                run=run,
                version=version,
                expired_s_ago=round(now - expires, 1),
                hint="the publisher re-signs LATEST while it runs; is it alive, and is its clock "
                "right (it says so when it differs from the store's)?",
            )
        with self._lock:
            seen = self._state.latest.get(run)
            if seen is not None and version < seen:
                raise TrustError(
                    "LATEST is older than a version already verified (rollback)",
                    reason="rollback",
                    run=run,
                    version=version,
                    verified=seen,
                    hint="an old LATEST replayed, or the run deleted and published again under "
                    "its name (not allowed: publish under a new run name); once the cause is "
                    "known, a reader's rollback state is its --trust-state file"
                    + (f" ({self.state_path})" if self.state_path is not None else ""),
                )
            if seen is None or version > seen:
                self._state.latest[run] = version
                self._save()

    def highest(self, run: str) -> int | None:
        """The highest LATEST version verified for ``run`` (persisted)."""
        with self._lock:
            return self._state.latest.get(run)

    def _save(self) -> None:
        """Persist the state. A disk that refuses it (full, read only) does not stop the
        verifier: what was verified is kept in memory, so this process still refuses every
        rollback; only a restart would fall back to the state last saved. Said as a WARNING
        once a minute (``save_errors`` counts them); saved again at the next change."""
        if self.state_path is None:
            return
        try:
            self._state.save(self.state_path)
        except OSError as e:
            self.save_errors += 1
            self._said.event(
                "trust_state_unsaved",
                str(self.state_path),
                logging.WARNING,
                path=str(self.state_path),
                error=e.strerror or str(e),
                effect="rollback protection across a restart stays at the state last saved",
            )


def _unchained(root: Root, e: TrustError) -> TrustError:
    """Root ``root.version + 1`` on the board does not verify against the trusted root: what
    anyone who can write to the store could put there (found by an audit, session 40: one
    forged root stopped every follower and the publisher's next rotation, and nothing said
    what to do)."""
    n = root.version + 1
    return TrustError(
        f"root {n} on the board does not chain from the trusted root {root.version} "
        f"({e.message}): forged or broken, so nothing is accepted past it",
        reason="root",
        hint=f"if the publisher did not make it, keep a copy and remove root/{n:012d}.json from "
        f"the board; a real rotation is signed by root {root.version}'s threshold and its own "
        "(docs/trust.md)",
    )


def _other_board(root: Root, fetch: Callable[[int], bytes | None]) -> TrustError | None:
    """When the board's root of the trusted root's version names other keys than the trusted
    one: the trust file is another board's (or another key's), which said "root N+1 is not
    signed by the previous root's keys", as if the board's rotation were broken (found by an
    audit, session 38). None when the board's root agrees, or cannot be read."""
    try:
        same = fetch(root.version)
        theirs = None if same is None else verify_initial_root(same)
    except RollpatchError:
        return None
    if theirs is None or set(theirs.keys) == set(root.keys):
        return None
    return TrustError(
        f"the trusted root (version {root.version}) is not this board's root "
        f"{root.version}: their keys differ (a --trust file made for another board or key?)",
        reason="root",
        hint="trust this board's own first root: `rollpatch status --board URI --trust FILE` "
        "names what the board holds; docs/trust.md",
    )
