"""How trainer ranks exchange small JSON messages while publishing a sharded version.

Every rank publishes its own shard's objects, then the ranks all-gather one JSON message each
(object refs, per-tensor digests, or an error) and rank 0 writes the manifest. Messages travel
as UTF-8 JSON in ``uint8`` tensors over a dedicated gloo group — never pickled (no
``gather_object``), and never on the trainer's own groups, so the publisher's background thread
cannot interleave with the training loop's collectives. torch is imported only here, only when
sharding is used.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Protocol

from ..errors import BoardError, ConfigError

__all__ = ["Exchange", "GlooExchange", "LocalExchange", "ThreadGroup", "open_exchange"]

#: Largest message one rank may send in one exchange (per-tensor digests of huge models fit).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


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
        import threading

        self.size = size
        self._box: list[Any] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout_s)

    def member(self, rank: int) -> Exchange:
        return _ThreadExchange(self, rank)

    def _allgather(self, rank: int, message: Any) -> list[Any]:
        import threading

        self._box[rank] = json.loads(json.dumps(message))
        try:
            self._barrier.wait()
            out = list(self._box)
            self._barrier.wait()
        except threading.BrokenBarrierError as e:
            raise BoardError("a publisher rank (thread) stopped answering", rank=rank) from e
        return out


class _ThreadExchange:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._g, self.rank, self.size = group, rank, group.size

    def allgather(self, message: Any) -> list[Any]:
        return self._g._allgather(self.rank, message)


class GlooExchange:
    """All-gather over a dedicated gloo group made from ``group`` (None: the whole world).

    Creating it is a collective: every rank of ``group`` must construct it, in the same order
    relative to the other groups they create.
    """

    def __init__(self, group: Any = None, timeout_s: float | None = None) -> None:
        import datetime

        import torch.distributed as dist

        extra: dict[str, Any] = {}
        if timeout_s is not None:
            extra["timeout"] = datetime.timedelta(seconds=timeout_s)
        if group is None:
            self._group = dist.new_group(backend="gloo", **extra)
        else:
            ranks = dist.get_process_group_ranks(group)
            self._group = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=True, **extra
            )
        self.rank = dist.get_rank(self._group)
        self.size = dist.get_world_size(self._group)

    def allgather(self, message: Any) -> list[Any]:
        raw = json.dumps(message, separators=(",", ":")).encode()
        if len(raw) > MAX_MESSAGE_BYTES:
            raise ConfigError("publisher message between ranks is too large", size=len(raw))
        try:
            return self._allgather(raw)
        except RuntimeError as e:  # gloo: a peer's connection closed (it died) or timed out
            raise BoardError(
                "a publisher rank stopped answering (its process died, or it "
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


def open_exchange(group: Any, sharded: bool | None, timeout_s: float | None = None) -> Exchange:
    """The exchange a publisher uses: gloo over ``group`` when sharding, else local.
    ``timeout_s``: how long a rank waits in one exchange for the others (None: gloo's
    default, 30 minutes); a rank whose process dies is noticed at once either way.

    ``sharded=None`` shards when ``group`` is given or torch.distributed is initialised with
    more than one rank (torch is never imported just to find out); ``False`` never shards
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
    return GlooExchange(group, timeout_s)


def _is_exchange(group: Any) -> bool:
    """An :class:`Exchange` (``rank``/``size`` ints), not a torch ProcessGroup (methods)."""
    return (
        group is not None
        and isinstance(getattr(group, "rank", None), int)
        and isinstance(getattr(group, "size", None), int)
        and callable(getattr(group, "allgather", None))
    )
