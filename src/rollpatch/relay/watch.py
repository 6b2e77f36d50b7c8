"""Long-polls of LATEST: a follower's ``GET .../runs/R/LATEST?after=N&wait=S`` is held until
the relay knows a LATEST newer than ``N`` (or ``S`` seconds pass), so a new version reaches the
islands one one-way trip after the relay learns of it, instead of a polling period later.

While anyone waits on a run, one thread per run keeps the relay's LATEST fresh: through a long
poll of its own when the upstream is another relay (chains of relays pass a version on at
once), else by reading LATEST every ``watch_s`` (directory and S3 boards; on Linux a directory
board also wakes the watch the moment LATEST is renamed into place: :class:`Notice`). Each
LATEST read
is checked as any other (signature, freshness, rollback) and refreshes the TTL cache that
plain GETs are answered from. A held answer is only a hint — followers read and verify LATEST
and the signed manifest as always — so a relay can delay a version, never forge one.

With ``prefetch`` (the default), a new version is *announced* — long-polls answered, the TTL
cache of LATEST refreshed — only once its manifest and the step patch objects it names are
fetched, verified and cached: a follower woken by the answer finds everything it needs here,
and a version whose manifest or patch is refused is never announced (counted and logged; the
watch tries it again with backoff, and announces the next version that passes).

With ``push_bytes`` (docs/relay.md, "Push"), a relay long-polling a relay upstream asks for
those objects *in* the answer that announces the version (:mod:`rollpatch.store.push`), and
checks and caches them as if it had fetched them: the version crosses the WAN in one one-way
trip instead of one plus a round trip. What is not pushed, or is refused, is fetched as before.
Each such long-poll also names what the relay holds of the newest version it learned of
upstream (``&have=``), so a long-poll whose ``after`` did not move past that version (the
watch restarted, or the version could not be announced and is asked for again) is not
answered with the same bytes again.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..errors import RollpatchError
from ..latest import MAX_POINTER_BYTES, read_latest
from ..layout import manifest_version, object_hash, objects_prefix, pointer_run, version_key
from ..logs import event
from ..manifest import open_manifest
from ..store.http_client import HttpStore
from ..store.http_pool import Held
from ..store.push import MAX_PUSHED, frame_push, have_token
from .core import Blob, Relay
from .learned import Learned
from .notice import Notice
from .unannounced import held_back
from .verify import StalePointer

__all__ = ["MAX_PUSH_BYTES", "PREFETCH_HEADER", "PointerWatch"]

log = logging.getLogger("rollpatch.relay")
#: Seconds the watch of a run outlives its last waiter (followers ask again at once).
LINGER_S = 10.0
#: The longest wait between two LATEST reads while they keep failing.
MAX_BACKOFF_S = 5.0
#: Runs watched at once (a thread each); long-polls of further runs are answered at once.
MAX_RUNS = 256
#: Longest wait for one prefetched object before the version is left unannounced (retried).
PREFETCH_TIMEOUT_S = 120.0
#: Header of a held answer: the keys (space-separated) of the announced version's manifest and
#: step patch objects, so a relay downstream fetches them at once, in parallel (a hint only:
#: what it announces is still what the manifest it verified names).
PREFETCH_HEADER = "X-Rollpatch-Prefetch"
#: Most hinted keys a relay fetches for one version.
MAX_HINTED = 16
#: Most bytes a relay pushes in one answer, whatever a downstream relay accepts.
MAX_PUSH_BYTES = 256 << 20


@dataclass
class _Run:
    version: int = -1  # newest version seen (-1: none yet)
    blob: Blob | None = None
    waiters: list[tuple[int, Future[Blob]]] = field(default_factory=list)
    thread: threading.Thread | None = None
    last_wait: float = 0.0
    refused: int = -1  # newest version left unannounced (logged once at WARNING)
    hint: str = ""  # PREFETCH_HEADER of the announced version
    parts: list[tuple[str, bytes]] | None = None  # its objects, once read for a push
    heard: float = field(default_factory=time.monotonic)  # last upstream answer on LATEST


class PointerWatch:
    """The relay's long-poll waiters, and the threads that keep LATEST fresh for them."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._closed = threading.Event()
        self._held: list[Held] = []
        #: what a long-poll's ``have`` is drawn from; outlives the runs' watches
        self._record = Learned()

    def wait(self, key: str, after: int) -> Future[Blob] | None:
        """A future of the LATEST at ``key`` once it names a version above ``after`` (never
        failed; the caller stops waiting on its own deadline and calls :meth:`forget`).
        None when :data:`MAX_RUNS` other runs are watched: answer at once instead."""
        future: Future[Blob] = Future()
        with self._lock:
            if key not in self._runs and len(self._runs) >= MAX_RUNS:
                return None
            st = self._runs.setdefault(key, _Run())
            st.last_wait = time.monotonic()
            if st.blob is not None and st.version > after and st.thread is not None:
                future.set_result(st.blob)
                return future
            st.waiters.append((after, future))
            if st.thread is None and not self._closed.is_set():
                st.thread = threading.Thread(
                    target=self._run, args=(key, st), daemon=True, name="relay-watch"
                )
                st.thread.start()
        return future

    def hint(self, key: str, blob: Blob) -> str:
        """:data:`PREFETCH_HEADER` for an answer of ``blob`` (empty: none)."""
        with self._lock:
            st = self._runs.get(key)
            return st.hint if st is not None and st.blob is blob else ""

    def push(
        self, key: str, blob: Blob, after: int, limit: int, have: frozenset[str] = frozenset()
    ) -> tuple[str, list[bytes]] | None:
        """The pushed answer of ``blob`` (the ``X-Rollpatch-Push`` value and the body pieces)
        for a downstream relay that holds ``after`` and the objects named in ``have``
        (:func:`~rollpatch.store.push.have_token`, left out) and accepts ``limit`` bytes;
        None when ``blob`` is not a newer announced version, the downstream holds all of its
        objects, or they are not all cached or do not fit (the answer is then plain, with the
        prefetch hint). Reads cache files: call it off the event loop."""
        with self._lock:
            st = self._runs.get(key)
            if st is None or st.blob is not blob or st.version <= after or not st.hint:
                return None
            parts, keys = st.parts, st.hint.split()[:MAX_PUSHED]
        if blob.data is None:
            return None
        limit = min(limit, MAX_PUSH_BYTES) - blob.size
        wanted = {k for k in keys if have_token(k) not in have}
        if len(wanted) < len(keys):  # the downstream holds these: they cross the WAN once
            held = len(keys) - len(wanted)
            self.relay.metrics.inc("rollpatch_relay_pushed_total", held, outcome="held")
        if not wanted:
            return None
        if parts is None:
            entries = [self.relay.cache.lookup(k) for k in keys]
            if any(e is None for e in entries):
                return None
            if sum(e.size for e in entries if e and e.key in wanted) > limit:
                return None
            try:
                parts = [(e.key, self.relay.read(Blob.cached(e))) for e in entries if e]
            except RollpatchError:  # evicted meanwhile
                return None
            with self._lock:
                if st.blob is blob:
                    st.parts = parts
        sending = [(k, b) for k, b in parts if k in wanted]
        if sum(len(b) for _, b in sending) > limit:
            return None
        self.relay.metrics.inc("rollpatch_relay_pushed_total", len(sending), outcome="sent")
        return frame_push(blob.data, sending)

    def latest_age(self) -> float:
        """Seconds since the watch last heard from upstream about LATEST (an answer, or a
        long-poll that ended without news), the oldest over the runs watched; 0: none."""
        now = time.monotonic()
        with self._lock:
            heard = [st.heard for st in self._runs.values() if st.thread is not None]
        return max((now - h for h in heard), default=0.0)

    def announced(self, key: str) -> Blob | None:
        """The newest LATEST the watch of ``key`` announced (None: no watch, or none yet):
        what a long-poll that timed out answers, so it never names a version whose
        prefetch failed."""
        with self._lock:
            st = self._runs.get(key)
            return st.blob if st is not None and st.thread is not None else None

    def forget(self, key: str, future: Future[Blob]) -> None:
        """Stop holding ``future`` (its waiter gave up)."""
        with self._lock:
            st = self._runs.get(key)
            if st is not None:
                st.waiters = [w for w in st.waiters if w[1] is not future]
        future.cancel()

    def close(self) -> None:
        """Stop every watch thread (their upstream long-polls are cancelled) and answer every
        waiter now: with the LATEST the relay has, or by cancelling its future."""
        self._closed.set()
        with self._lock:
            held = list(self._held)
            waiting = [(st.blob, f) for st in self._runs.values() for _, f in st.waiters]
            for st in self._runs.values():
                st.waiters = []
        for h in held:
            h.cancel()
        for blob, f in waiting:
            if blob is None:
                f.cancel()
            elif not f.done():
                f.set_result(blob)

    # -- the watch of one run -----------------------------------------------------------------

    def _run(self, key: str, st: _Run) -> None:
        upstream = self.relay.upstream
        held = own = upstream.held() if isinstance(upstream, HttpStore) else None
        if own is not None:
            with self._lock:
                self._held.append(own)
        first, failures = True, 0
        notice = Notice(upstream, key, self._closed)
        try:
            while not self._closed.is_set():
                with self._lock:  # the exit and the thread's reset are one step for wait()
                    if not st.waiters and time.monotonic() - st.last_wait > LINGER_S:
                        st.thread = None
                        if self._runs.get(key) is st:
                            del self._runs[key]  # a run nobody waits on is forgotten
                        return
                    after = st.version
                try:
                    started = time.monotonic()
                    data, read_at, hinted, pushed = self._read(key, after, held, first, notice)
                    st.heard = time.monotonic()
                    try:
                        newer = data is not None and self._learned(
                            key, st, data, read_at, hinted, pushed, started=started
                        )
                    except StalePointer:  # a newer LATEST was verified while this one came:
                        newer = True  # ask again at once (waiting would lag behind it)
                    early = time.monotonic() - started < 1.0
                    if held is not None and data is not None and not newer and early:
                        self._closed.wait(self.relay.config.watch_s)  # nothing new, at once
                    first, failures = False, 0
                except NotImplementedError:
                    held = None  # the upstream relay predates long-polls: read every watch_s
                    continue
                except (RollpatchError, OSError) as e:  # upstream_down said by relay.calls
                    failures += 1
                    delay = min(self.relay.config.watch_s * 2**failures, MAX_BACKOFF_S)
                    log.debug("relay watch of %s: %s: %s", key, type(e).__name__, e)
                    self._closed.wait(delay)
        finally:
            with self._lock:
                if st.thread is threading.current_thread():
                    st.thread = None
                if own is not None and own in self._held:
                    self._held.remove(own)
            if own is not None:
                own.close()
            notice.close()

    def _read(
        self, key: str, after: int, held: Held | None, first: bool, notice: Notice
    ) -> tuple[bytes | None, float, str, list[tuple[str, bytes]]]:
        """LATEST read upstream, when, the upstream relay's prefetch hint (or "") and the
        objects it pushed (unverified)."""
        upstream = self.relay.upstream
        pushed: list[tuple[str, bytes]] = []
        if held is not None and isinstance(upstream, HttpStore):
            wait_s = max(self.relay.config.hold_s, 1.0)
            headers: dict[str, str] = {}
            push = self.relay.config.push_bytes if self.relay.config.prefetch else 0
            have = self._record.have(key, self.relay.cache) if push else []
            data = self.relay.calls.call(
                "wait",
                lambda k: upstream.wait_newer(
                    k, after, wait_s, held, headers, push_bytes=push, pushed_out=pushed, have=have
                ),
                key,
            )
            hint = next((v for k, v in headers.items() if k.lower() == PREFETCH_HEADER.lower()), "")
            return data, time.monotonic(), hint, pushed
        if not first and notice.wait(self.relay.config.watch_s):
            return None, 0.0, "", pushed
        read_at = time.monotonic()
        data = self.relay.calls.call(
            "get", lambda k: upstream.get(k, max_bytes=MAX_POINTER_BYTES), key
        )
        return data, read_at, "", pushed

    def _learned(
        self,
        key: str,
        st: _Run,
        data: bytes,
        read_at: float,
        hinted: str = "",
        pushed: list[tuple[str, bytes]] | None = None,
        *,
        started: float | None = None,
    ) -> bool:
        """Serve ``data`` (checked) as the run's LATEST; whether it names a newer version.

        A newer version is prefetched first (``prefetch``): what the upstream pushed is
        checked and cached, the rest fetched; :class:`~.unannounced.Unannounced` when that fails, and
        nothing changes (waiters stay held, the TTL cache keeps the old LATEST)."""
        run = pointer_run(key)
        if run is None:
            return False
        # refused before anything it names (stale: overtaken by a LATEST verified meanwhile)
        p = self.relay.verifier.check_pointer(key, data, started=started)
        version = read_latest(data, run, None)[0].version
        if p is not None:  # a run published again under its name: its manifest, not ours
            self.relay.lineage.pointer(p.manifest, p.target)
        with self._lock:
            newer = version > st.version
        hint = ""
        if newer and self.relay.config.prefetch:
            pushed = [(k, b) for k, b in (pushed or ())[:MAX_PUSHED] if _ours(k, run, version)]
            hinted_keys = [k for k in hinted.split()[:MAX_HINTED] if _ours(k, run, version)]
            self._record.learn(key, [k for k, _ in pushed] + hinted_keys)  # kept if prefetch fails
            for k, b in pushed:
                self.relay.accept(k, b)
            self._start_hinted(run, version, hinted)
            hint = " ".join(self._prefetch(run, version, st))
            self._record.learn(key, hint.split())
            read_at = time.monotonic()  # the watch kept LATEST current meanwhile
        blob = self.relay.remember_pointer(key, data, read_at)
        with self._lock:
            newer = version > st.version
            if newer:
                st.version, st.blob, st.hint, st.parts = version, blob, hint, None
            ready = [f for a, f in st.waiters if version > a]
            st.waiters = [(a, f) for a, f in st.waiters if version <= a]
        for f in ready:
            if not f.done():
                f.set_result(blob)
        return newer

    def _start_hinted(self, run: str, version: int, hinted: str) -> None:
        """Start fetching what the upstream relay's hint names (only ``version``'s manifest
        and objects of ``run``, at most :data:`MAX_HINTED`): the step patch then crosses the
        WAN beside the manifest instead of one round trip after it."""
        for k in hinted.split()[:MAX_HINTED]:
            if _ours(k, run, version):
                try:
                    self.relay.resolve(k)  # joined by _prefetch; errors surface there
                except RollpatchError as e:
                    log.debug("relay hinted prefetch of %s: %s", k, e)

    def _prefetch(self, run: str, version: int, st: _Run) -> list[str]:
        """Fetch, verify and cache ``version``'s manifest, then its step patch objects (at
        once); their keys. Raise :class:`~.unannounced.Unannounced` if any is refused, missing or too
        slow."""
        relay = self.relay
        started = time.monotonic()
        try:
            blob = relay.resolve(version_key(run, version)).result(PREFETCH_TIMEOUT_S)
            raw = relay.read(blob)
            m = open_manifest(raw, run, version, None)
            steps = m.patches_from(m.parent) if m.parent is not None else ()
            pending = [relay.resolve(p.ref.key) for p in steps]
            for f in pending:
                f.result(PREFETCH_TIMEOUT_S)
        except (RollpatchError, OSError, ValueError, FutureTimeout) as e:
            first = st.refused < version
            st.refused = max(st.refused, version)
            raise held_back(relay.metrics, run, version, e, first=first) from e
        event(
            log,
            "prefetched",
            logging.DEBUG,
            run=run,
            version=version,
            objects=len(pending),
            seconds=round(time.monotonic() - started, 4),
        )
        return [version_key(run, version), *(p.ref.key for p in steps)]


def _ours(key: str, run: str, version: int) -> bool:
    """Whether a hinted or pushed ``key`` is ``version``'s manifest or an object of ``run``."""
    return manifest_version(key) == (run, version) or (
        object_hash(key) is not None and key.startswith(objects_prefix(run))
    )
