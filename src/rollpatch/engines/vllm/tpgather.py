"""Reading a checkpoint tensor at TP > 1: an all-gather of every rank's block, as bytes.

Every rank of a vLLM TP group holds a block of each split tensor; the worker's digests, checks
and decoder need the whole tensor, so every rank gathers it (the same tensors in the same
order on every rank: a collective). :class:`TpGather` owns how:

- **as bytes** (``uint8``): vLLM's CPU shared-memory all-gather (``shm_all_gather``) takes
  floating types only and NCCL has no int16, so an int16 gather fails on both; a byte copy
  keeps every bit (NaN payloads included) whatever the element type;
- **on the engine loop** (the worker's operations, called by ``collective_rpc`` on every rank
  in one order): through the TP group's gloo ``cpu_group`` on the CPU (not vLLM's
  shared-memory path), through the TP group itself elsewhere (NCCL on GPUs, untested);
- **from the staging thread** (:meth:`TpGather.own`): through a gloo group of rollpatch's own
  over the same ranks, so staging at TP > 1 can run beside the engine loop (each rank's
  staging thread gathers the same tensors in the same order) without its collectives
  interleaving with the engine loop's on one group. The group is made when the worker's
  state is built (every rank builds it in the same ``collective_rpc``), and only when the
  torch.distributed world is this TP group (no pipeline or data parallelism in it: making a
  group is a collective over the whole world, whose other ranks would not join); elsewhere
  :attr:`TpGather.background` is False and staging runs inline on the engine loop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["TpGather"]


class TpGather:
    """The TP group's all-gather of words (module docstring); ``cpu``: the parameters live in
    host memory."""

    def __init__(self, tp: int, *, cpu: bool) -> None:
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        self.tp, self.cpu, self._own = tp, cpu, threading.local()
        self._group = get_tp_group()
        self._staging: Any = None
        if dist.get_world_size() == tp and list(self._group.ranks) == list(range(tp)):
            self._staging = dist.new_group(list(range(tp)), backend="gloo")

    @property
    def background(self) -> bool:
        """Whether a thread may gather beside the engine loop (:meth:`own`)."""
        return self._staging is not None

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """The calling thread's gathers go through rollpatch's own group (the staging thread;
        only where :attr:`background`)."""
        if self._staging is None:
            raise RuntimeError("no group of rollpatch's own: staging runs on the engine loop")
        self._own.on = True
        try:
            yield
        finally:
            self._own.on = False

    def _gloo(self) -> Any:
        """The calling thread's gloo group (None: the TP group's device communicator)."""
        if getattr(self._own, "on", False):
            return self._staging
        return self._group.cpu_group if self.cpu else None

    def gather(self, local: np.ndarray, device: Any) -> list[np.ndarray]:
        """Every rank's ``local`` (the same shape on each), in rank order. On gloo, one
        broadcast from each rank: gloo's own all-gather moved 32 MB per rank in 70 ms on this
        host's loopback, a broadcast in 8 (``docs/vllm.md``, *TP > 1*)."""
        import torch

        raw = torch.from_numpy(np.ascontiguousarray(local).reshape(-1).view(np.uint8))
        group = self._gloo()
        if group is not None:
            me = self._group.rank_in_group
            parts = [raw if r == me else torch.empty_like(raw) for r in range(self.tp)]
            for r, part in enumerate(parts):
                self._broadcast(part, r, group)
        else:
            parts = list(self._group.all_gather(raw.to(device), dim=0).chunk(self.tp))
        return self._words(parts, local)

    def gather_to(
        self, local: np.ndarray, device: Any, dst: int
    ) -> Callable[[], list[np.ndarray] | None]:
        """Every rank's ``local`` (the same shape on each), in rank order, on TP rank ``dst``
        only (None on the others): a tensor decoded by one rank (:mod:`.tpdecode`). Started
        now, finished by calling what it returns (before the next collective of another
        kind; transfers started in one order on every rank complete in that order), so the
        next tensor can travel while this one is decoded. On gloo, sends to ``dst`` and its
        receives: gloo's own gather ran at a sixth of a send's rate on this host; ``local``
        must then stay unchanged until the call (staging: nothing writes the parameters)."""
        import torch
        import torch.distributed as dist

        raw = torch.from_numpy(np.ascontiguousarray(local).reshape(-1).view(np.uint8))
        group = self._gloo()
        me = self._group.rank_in_group
        if group is None:  # the device communicator's gather, done now
            got = self._group.gather(raw.to(device), dst=dst, dim=0)
            parts = list(got.chunk(self.tp)) if me == dst and got is not None else None
            return lambda: None if parts is None else self._words(parts, local)
        if me != dst:
            sent = dist.isend(raw, dst=dist.get_global_rank(group, dst), group=group)

            def sent_done(keep: Any = raw) -> None:  # the buffer lives until the send is done
                if sent is not None:
                    sent.wait()
                del keep

            return sent_done
        bufs = [raw if r == me else torch.empty_like(raw) for r in range(self.tp)]
        waits = [
            dist.irecv(bufs[r], src=dist.get_global_rank(group, r), group=group)
            for r in range(self.tp)
            if r != me
        ]

        def received() -> list[np.ndarray]:
            for w in waits:
                if w is not None:
                    w.wait()
            return self._words(bufs, local)

        return received

    @staticmethod
    def _words(parts: list[Any], local: np.ndarray) -> list[np.ndarray]:
        return [c.cpu().numpy().view(local.dtype).reshape(local.shape) for c in parts]

    def share(self, data: bytes | None, device: Any, src: int, size: int) -> memoryview:
        """TP rank ``src``'s ``data`` (``size`` bytes; the others pass None) on every rank:
        one broadcast, every rank knowing the size."""
        import torch

        group = self._gloo()
        if self._group.rank_in_group == src and data is not None:
            if len(data) != size:
                raise ValueError("share: the data is not of the size given")
            buf = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if size
                else torch.empty(0, dtype=torch.uint8)
            )
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        if group is None:
            buf = buf.to(device)
        buf = self._broadcast(buf, src, group)
        return memoryview(buf.cpu().numpy()).cast("B")

    @property
    def delivers(self) -> bool:
        """Whether :meth:`deliver` can run for the calling thread (a gloo group: sends and
        receives between pairs of ranks; the device communicator path has none here)."""
        return self._gloo() is not None

    def deliver(self, parts: list[bytes], sizes: list[int]) -> list[memoryview]:
        """Point to point, every pair at once: ``parts[q]`` to each other TP rank ``q``, and
        from each other rank ``q`` the ``sizes[q]`` bytes it sends this one (sizes every
        receiver knows); returns what each rank sent (this rank's own entry empty). A
        collective, through the calling thread's gloo group (:attr:`delivers`)."""
        import torch
        import torch.distributed as dist

        group = self._gloo()
        if group is None:
            raise RuntimeError("deliver: no gloo group for this thread")
        me = self._group.rank_in_group
        keep, waits = [], []
        got = [torch.empty(0, dtype=torch.uint8) for _ in range(self.tp)]
        for q in range(self.tp):
            if q == me:
                continue
            peer = dist.get_global_rank(group, q)
            data = parts[q]
            out = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
            if out is not None:  # a send of nothing is no send: the peer expects 0 bytes
                keep.append(out)
                waits.append(dist.isend(out, dst=peer, group=group))
            if sizes[q]:
                got[q] = torch.empty(sizes[q], dtype=torch.uint8)
                waits.append(dist.irecv(got[q], src=peer, group=group))
        for w in waits:
            if w is not None:
                w.wait()
        del keep
        return [memoryview(g.numpy().data).cast("B") for g in got]

    def _broadcast(self, t: Any, src: int, group: Any) -> Any:
        import torch.distributed as dist

        if group is None:
            return self._group.broadcast(t, src=src)
        dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
        return t
