"""Fetching for the follower: bounded retries with backoff, parallel verified object fetch.

Every object goes through :meth:`Board.fetch`, which checks its size and BLAKE3 hash against
the manifest entry; a mismatch (corrupt or truncated bytes), a missing object and a transient
store failure are retried with exponential backoff, within ``timeout_s`` per object. Anything
else (a read-only store, a bad key) fails at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from ..board import Board
from ..errors import (
    ManifestError,
    NotFoundError,
    NotReadyError,
    RollpatchError,
    TransientStoreError,
)
from ..store import ObjectInfo, Store, open_reader_store
from ..trust import Trust, warn_unverified
from ..types import ObjectRef
from .config import FollowerConfig

__all__ = [
    "RETRY_FETCH",
    "RETRY_READ",
    "FetchPool",
    "Retrier",
    "RetryingStore",
    "fetch_objects",
    "trusted_board",
]

T = TypeVar("T")

#: Failures worth fetching an object again for: the network, eventual consistency, bad bytes
#: from a cache or relay (Board.fetch raises ManifestError on a size or hash mismatch).
RETRY_FETCH: tuple[type[BaseException], ...] = (
    TransientStoreError,
    NotFoundError,
    ManifestError,
    TimeoutError,
    ConnectionError,
)
#: Failures worth reading LATEST or a manifest again for (a malformed manifest is final).
RETRY_READ: tuple[type[BaseException], ...] = (TransientStoreError, TimeoutError, ConnectionError)


class Retrier:
    """Calls a function up to ``1 + retries`` times, sleeping ``backoff_s · 2^attempt``.

    ``abort`` interrupts the sleeps (the follower is stopping); ``on_retry`` is told about
    every failure that is retried (for counters and logs).
    """

    def __init__(
        self,
        config: FollowerConfig,
        abort: threading.Event,
        on_retry: Callable[[BaseException], None],
    ) -> None:
        self.config = config
        self.abort = abort
        self.on_retry = on_retry

    def call(
        self,
        fn: Callable[[], T],
        retryable: tuple[type[BaseException], ...],
        deadline: float | None = None,
    ) -> T:
        """``fn()``, retried on ``retryable`` failures until ``retries`` or ``deadline``."""
        attempt = 0
        while True:
            try:
                return fn()
            except retryable as e:
                delay = self.config.backoff_s * (2**attempt)
                if attempt >= self.config.retries or (
                    deadline is not None and time.monotonic() + delay >= deadline
                ):
                    if attempt and isinstance(e, RollpatchError):  # all of them, not the last's
                        e.context["attempts"] = attempt + 1
                        e.args = (e._render(),)
                    raise
                self.on_retry(e)
                if self.abort.wait(delay):
                    raise NotReadyError("follower is stopping; fetch abandoned") from e
                attempt += 1


class RetryingStore(Store):
    """A read-only view of ``inner`` whose every read is retried on transient failures.

    The follower reads LATEST and manifests through a :class:`Board` over this store, so one
    failed request costs one retry of that request, not a re-run of a whole plan.
    """

    writable = False

    def __init__(self, inner: Store, retrier: Retrier) -> None:
        self.inner = inner
        self.retrier = retrier
        self.uri = inner.uri

    def _get(self, key: str) -> bytes:
        return self.retrier.call(lambda: self.inner.get(key), RETRY_READ)

    def _get_bounded(self, key: str, max_bytes: int) -> bytes:
        return self.retrier.call(lambda: self.inner.get(key, max_bytes=max_bytes), RETRY_READ)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self.retrier.call(lambda: self.inner.get_range(key, start, end), RETRY_READ)

    def _list(self, prefix: str) -> list[str]:
        return self.retrier.call(lambda: self.inner.list(prefix), RETRY_READ)

    def _head(self, key: str) -> ObjectInfo | None:
        return self.retrier.call(lambda: self.inner.head(key), RETRY_READ)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        raise AssertionError("unreachable: the store is read-only")

    def _delete(self, key: str) -> None:
        raise AssertionError("unreachable: the store is read-only")

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        raise AssertionError("unreachable: the store is read-only")


class FetchPool:
    """One follower's fetch workers, kept from one fetch to the next (syncs are serialised).

    Why: a pool made per fetch started its worker on the way to every new version, and
    ``Thread.start`` waits until the new thread has run; on a busy host (islands decoding
    beside each other, a trainer casting) that wait was milliseconds per sync
    (``bench/peers.py``'s "patch" phase). An idle worker here just takes the next object.

    A fetch that fails may leave a store call running in a worker (it cannot be
    interrupted): :meth:`discard` then drops the pool (its workers finish, or hang, on their
    own, as a per-fetch pool's did) and the next fetch gets new ones.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        """The pool (made on first use: its threads start as objects need them)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.workers, thread_name_prefix="rollpatch-fetch"
                )
            return self._pool

    def discard(self) -> None:
        """Drop the pool: queued fetches are cancelled, idle workers exit, and a call in
        flight is abandoned (its result is dropped). The next :meth:`get` makes a new one."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def discard_idle(self, busy: threading.Lock) -> None:
        """:meth:`discard` unless ``busy`` (the owner's lock around its fetches) is held: a
        stopped owner keeps no idle worker, and a fetch in progress keeps its pool."""
        if busy.acquire(blocking=False):
            try:
                self.discard()
            finally:
                busy.release()


def fetch_objects(
    board: Board,
    refs: Iterable[ObjectRef],
    retrier: Retrier,
    on_fetched: Callable[[ObjectRef], None],
    on_data: Callable[[ObjectRef, bytes], None] | None = None,
    *,
    workers: FetchPool | None = None,
) -> dict[str, bytes]:
    """Fetch and verify ``refs`` concurrently; key → bytes, or raise the first failure.
    ``on_data`` is handed each verified object as it arrives (e.g. to decode it early).

    Each object gets ``timeout_s`` from the moment a worker starts on it, retries included;
    one that runs over fails the whole fetch with :class:`TransientStoreError`. On failure the
    remaining objects are cancelled (a store call already in flight cannot be interrupted and
    is abandoned; its result is dropped). ``workers``: a :class:`FetchPool` whose workers
    are reused (discarded on failure); None: a pool of this fetch's own.
    """
    unique = {r.key: r for r in refs}
    if not unique:
        return {}
    config = retrier.config
    started: dict[str, float] = {}
    lock = threading.Lock()
    failed = threading.Event()  # stops the other workers' retries once the fetch has failed

    def attempt(ref: ObjectRef) -> bytes:
        if failed.is_set():
            raise NotReadyError("fetch abandoned: another object failed", key=ref.key)
        return board.fetch(ref)

    def one(ref: ObjectRef) -> bytes:
        t0 = time.monotonic()
        with lock:
            started[ref.key] = t0
        data = retrier.call(lambda: attempt(ref), RETRY_FETCH, deadline=t0 + config.timeout_s)
        on_fetched(ref)
        if on_data is not None:
            on_data(ref, data)
        return data

    pool = (
        workers.get()
        if workers is not None
        else ThreadPoolExecutor(
            max_workers=min(config.fetch_workers, len(unique)),
            thread_name_prefix="rollpatch-fetch",
        )
    )
    out: dict[str, bytes] = {}
    try:
        futures: dict[Future[bytes], ObjectRef] = {pool.submit(one, r): r for r in unique.values()}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
            for f in done:
                out[futures[f].key] = f.result()  # re-raises the worker's failure
            now = time.monotonic()
            with lock:
                late = [
                    k for k, t0 in started.items() if k not in out and now - t0 > config.timeout_s
                ]
            if late:
                raise TransientStoreError(
                    "object fetch timed out",
                    key=late[0],
                    timeout_s=config.timeout_s,
                    hint="raise FollowerConfig.timeout_s or check the store",
                )
    except BaseException:
        failed.set()
        if workers is not None:
            workers.discard()
        raise
    finally:
        if workers is None:
            pool.shutdown(wait=False, cancel_futures=True)
    return out


def trusted_board(board: str | Board, trust: Trust | None, who: str) -> Board:
    """The board a reader uses: ``trust`` verifies what is read (default: the board's own, if
    any; without one, unsigned boards are accepted and one warning line names ``who``;
    docs/trust.md)."""
    out = Board(open_reader_store(board), trust=trust) if isinstance(board, str) else board
    if trust is not None and out.trust is not trust:
        out = Board(out.store, trust=trust)
    if out.trust is None:
        warn_unverified(who)
    return out
