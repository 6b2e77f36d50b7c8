"""How trainer ranks exchange small JSON messages while publishing a sharded version.

Every rank publishes its own shard's objects, then the ranks all-gather one JSON message each
(object refs, per-tensor digests, or an error) and rank 0 writes the manifest. Messages travel
as UTF-8 JSON in ``uint8`` tensors over a dedicated gloo group — never pickled (no
``gather_object``), and never on the trainer's own groups, so the publisher's background thread
cannot interleave with the training loop's collectives. torch is imported only here, only when
sharding is used.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from typing import Any, Protocol

from ..errors import BoardError, ConfigError

__all__ = ["Exchange", "GlooExchange", "LocalExchange", "ThreadGroup", "open_exchange"]

#: Largest message one rank may send in one exchange (per-tensor digests of huge models fit).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: Seconds the ranks of an auto-sharded publisher (no ``group``, no ``sharded``) wait for each
#: other to construct it before a ``ConfigError`` (``sharded=True`` waits as long as
#: ``collective_timeout_s``, or gloo's 30 minutes).
HANDSHAKE_S = 120.0


class Exchange(Protocol):
    """A group of publisher ranks that can all-gather JSON-serialisable messages."""

    rank: int
    size: int

    def allgather(self, message: Any) -> list[Any]:
        """Every rank's message, indexed by rank (a collective: every rank must call it)."""
        ...


class LocalExchange:
    """The trivial group of one rank: an unsharded publisher."""

    rank = 0
    size = 1

    def allgather(self, message: Any) -> list[Any]:
        return [json.loads(json.dumps(message))]  # same JSON round trip as the real one


class ThreadGroup:
    """Ranks as threads of one process (tests, benches): ``member(r)`` is rank ``r``'s
    :class:`Exchange`, passed as ``Publisher(..., group=...)``; every rank must run in its own
    thread. Messages take the same JSON round trip as over gloo."""

    def __init__(self, size: int, timeout_s: float = 60.0) -> None:

        self.size, self.timeout_s = size, timeout_s
        self._cv = threading.Condition()
        self._box: list[Any] = [None] * size
        self._arrived, self._round = 0, 0
        self._out: list[Any] = []  # the last complete round's messages
        self._broken = False  # a rank timed out: every rank fails from now on
        self._aborted: int | None = None  # the rank that aborted (Publisher.abort)

    def member(self, rank: int) -> Exchange:
        return _ThreadExchange(self, rank)

    def _allgather(self, rank: int, message: Any) -> list[Any]:
        with self._cv:
            self._check(rank)
            self._box[rank] = json.loads(json.dumps(message))
            mine, self._arrived = self._round, self._arrived + 1
            if self._arrived == self.size:  # the last to arrive completes the round
                self._out, self._arrived, self._round = list(self._box), 0, mine + 1
                self._cv.notify_all()
                return self._out
            done = self._cv.wait_for(
                lambda: self._round != mine or self._broken or self._aborted is not None,
                self.timeout_s,
            )
            if self._round != mine:  # (no next round completes before this rank joins it)
                return self._out
            self._broken = self._broken or not done
            self._cv.notify_all()
            raise self._failure(rank)

    def _check(self, rank: int) -> None:
        if self._aborted is not None or self._broken:
            raise self._failure(rank)

    def _failure(self, rank: int) -> BoardError:
        if self._aborted is not None:
            return BoardError(aborted_text(self._aborted), rank=rank)
        return BoardError("a publisher rank (thread) stopped answering", rank=rank)

    def _abort(self, rank: int) -> None:
        with self._cv:
            if self._aborted is None:
                self._aborted = rank
            self._cv.notify_all()


class _ThreadExchange:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._g, self.rank, self.size = group, rank, group.size

    def allgather(self, message: Any) -> list[Any]:
        return self._g._allgather(self.rank, message)

    def abort(self) -> None:
        self._g._abort(self.rank)


def aborted_text(rank: int) -> str:
    return (
        f"publisher rank {rank} aborted (an exception in its trainer, or interpreter exit, "
        "ended its publisher): nothing of this version is pointed at"
    )


class GlooExchange:
    """All-gather over a dedicated gloo group made from ``group`` (None: the whole world).

    Creating it is a collective: every rank of ``group`` must construct it, in the same order
    relative to the other groups they create.
    """

    def __init__(
        self, group: Any = None, timeout_s: float | None = None, *, auto: bool = False
    ) -> None:
        import datetime

        import torch.distributed as dist

        extra: dict[str, Any] = {}
        if timeout_s is not None:
            extra["timeout"] = datetime.timedelta(seconds=timeout_s)
        if group is None and auto and hasattr(dist.distributed_c10d, "_set_pg_timeout"):
            self._group = _auto_group(dist, timeout_s)
        elif group is None:
            self._group = dist.new_group(backend="gloo", **extra)
        else:
            ranks = dist.get_process_group_ranks(group)
            self._group = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=True, **extra
            )
        self.rank = dist.get_rank(self._group)
        self.size = dist.get_world_size(self._group)
        self._abort_key = f"rollpatch/publisher-aborted/{self._group.group_name}"
        self._closed = False
        self._close_lock = threading.Lock()

    def close(self) -> None:
        """Destroy this rank's gloo group (local, not a collective), once no round can run
        on it: a publisher closed and built again after an error, as docs/publisher.md's
        recipe does, left one group (its threads and sockets) behind per rebuild (audit J
        L3). Later rounds raise ``BoardError``."""
        with self._close_lock:  # the worker's exit and abort() may both call it
            if self._closed:
                return
            self._closed = True
        import torch.distributed as dist

        with contextlib.suppress(Exception):  # torch already torn down: nothing to free
            if dist.is_initialized():
                dist.destroy_process_group(self._group)

    def abort(self) -> None:
        """This rank's publisher aborted: say so in the default store, so the other ranks'
        errors can name it when their next exchange fails (their gloo sees this process
        exit, or ``collective_timeout_s`` pass). Best effort: only a message depends on it."""
        with contextlib.suppress(Exception):  # no store, another torch: the generic message
            _default_store().set(self._abort_key, str(self.rank))

    def _who_aborted(self) -> int | None:
        try:
            store = _default_store()
            return int(store.get(self._abort_key)) if store.check([self._abort_key]) else None
        except Exception:  # noqa: BLE001 (the store went with rank 0: the generic message)
            return None

    def allgather(self, message: Any) -> list[Any]:
        if self._closed:
            raise BoardError("this publisher's exchange between ranks is closed", rank=self.rank)
        raw = json.dumps(message, separators=(",", ":")).encode()
        if len(raw) > MAX_MESSAGE_BYTES:
            raise ConfigError("publisher message between ranks is too large", size=len(raw))
        try:
            return self._allgather(raw)
        except RuntimeError as e:  # gloo: a peer's connection closed (it died) or timed out
            who = self._who_aborted()
            raise BoardError(
                aborted_text(who)
                if who is not None
                else "a publisher rank stopped answering (its process died, or it "
                "timed out): nothing of this version is pointed at",
                rank=self.rank,
                shards=self.size,
                cause=str(e).splitlines()[0][:200],
                hint="restart every rank; the publisher resumes from LATEST",
            ) from e

    def _allgather(self, raw: bytes) -> list[Any]:
        import torch
        import torch.distributed as dist

        size = torch.tensor([len(raw)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, size, group=self._group)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
        if raw:
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(out, buf, group=self._group)
        return [json.loads(o[: int(s.item())].numpy().tobytes()) for o, s in zip(out, sizes)]


def _auto_group(dist: Any, timeout_s: float | None) -> Any:
    """The whole world's gloo group for a publisher that shards because torch.distributed
    runs more than one rank (neither ``group`` nor ``sharded`` given): created with a
    :data:`HANDSHAKE_S` timeout, so a publisher constructed on one rank only (as for a
    gathered state dict) fails with a ``ConfigError`` instead of waiting 30 minutes in
    ``dist.new_group`` (audit J, H6); then given the collectives' own timeout."""
    import datetime

    wait = HANDSHAKE_S if timeout_s is None else min(HANDSHAKE_S, timeout_s)
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait))
    except RuntimeError as e:  # gloo or the store's barrier: the others never came
        raise ConfigError(
            f"torch.distributed runs {dist.get_world_size()} ranks, so the publisher shards "
            f"across all of them, but the other ranks did not construct one within {wait:.0f} s",
            rank=dist.get_rank(),
            cause=str(e).splitlines()[0][:200] if str(e) else type(e).__name__,
            hint="publishing from one process (a gathered state dict, a transformers "
            "Trainer's main process)? pass sharded=False; sharding? construct the publisher "
            "on every rank, or pass sharded=True to wait for them (collective_timeout_s)",
        ) from None
    long = dist.distributed_c10d.default_pg_timeout
    if timeout_s is not None:
        long = datetime.timedelta(seconds=timeout_s)
    dist.distributed_c10d._set_pg_timeout(long, group)
    return group


def _default_store() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def open_exchange(group: Any, sharded: bool | None, timeout_s: float | None = None) -> Exchange:
    """The exchange a publisher uses: gloo over ``group`` when sharding, else local.
    ``timeout_s``: how long a rank waits in one exchange for the others (None: gloo's
    default, 30 minutes); a rank whose process dies is noticed at once either way.

    ``sharded=None`` shards when ``group`` is given or torch.distributed is initialised with
    more than one rank (torch is never imported just to find out; the ranks must then all
    construct the publisher within :data:`HANDSHAKE_S`, else ``ConfigError``); ``False`` never shards
    (e.g. rank 0 publishes a state dict gathered from every rank). ``group`` may also be an
    :class:`Exchange` itself (any transport between the ranks, e.g. threads in one process).
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(
            "collective_timeout_s must be > 0 seconds", collective_timeout_s=timeout_s
        )
    if _is_exchange(group):
        if sharded is False:
            raise ConfigError("an Exchange was given as group= but sharded=False")
        return group
    if sharded is False:
        if group is not None:
            raise ConfigError("group= was given but sharded=False")
        return LocalExchange()
    if group is None:
        # a trainer that initialised torch.distributed has imported it; never import torch here
        dist = sys.modules.get("torch.distributed")
        if dist is None or not (dist.is_available() and dist.is_initialized()):
            if sharded:
                raise ConfigError("sharded=True needs torch.distributed initialised or group=")
            return LocalExchange()
        if dist.get_world_size() == 1 and not sharded:
            return LocalExchange()
    return GlooExchange(group, timeout_s, auto=group is None and sharded is None)


def _is_exchange(group: Any) -> bool:
    """An :class:`Exchange` (``rank``/``size`` ints), not a torch ProcessGroup (methods)."""
    return (
        group is not None
        and isinstance(getattr(group, "rank", None), int)
        and isinstance(getattr(group, "size", None), int)
        and callable(getattr(group, "allgather", None))
    )
