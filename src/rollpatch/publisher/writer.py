"""Publishing one agreed version across the ranks (the :class:`Publisher`'s worker calls it).

Each rank builds its shard (cast, diff, encode, upload), the ranks exchange the results, rank
0 writes the manifest and advances LATEST, every rank learns the outcome and commits its shard
state, and the version's :class:`VersionStats` are measured. Which version, and when, is the
:class:`~rollpatch.publisher.core.Publisher`'s business; how it lands on the board is here.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from .. import native
from ..board import Board
from ..errors import BoardError, ConfigError, FormatError, NoPathError, ObjectIntegrityError
from ..formats import cast_view, get_format
from ..io.checkpoint import to_numpy
from ..kinds import KINDS
from ..view import Tensor, View
from .assemble import assemble_manifest
from .config import PublisherConfig, VersionStats
from .keyframe import reconstruct_shard, shard_matches
from .pipeline import ShardPipeline
from .reconstruct import reconstruct
from .result import ShardResult
from .rounds import Snapshot
from .sharded import Exchange
from .wordpool import WordPool

__all__ = ["VersionWriter", "check_masters", "snapshot_served", "snapshot_state"]

log = logging.getLogger("rollpatch.publisher")

_MASTER_DTYPES = ("float32", "bfloat16", "float16")

#: Master elements from which the served snapshot casts on several threads (below it, a
#: pool's start costs about what the threads would save).
_THREADED_CAST_MIN = 1 << 20


def check_masters(state_dict: Mapping[str, Any], *, sharded: bool = False) -> None:
    """What every snapshot path needs of the masters, checked before any is taken, from
    their attributes only (no copy): names, then for torch tensors the device (a meta tensor
    has no values), the layout (dense) and the dtype; numpy arrays by their dtype. An empty
    state dict is refused unless ``sharded`` (a rank may hold no tensor of its own)."""
    if not state_dict and not sharded:
        raise ConfigError(
            "the state dict is empty: nothing to publish",
            hint="pass the model's parameters (e.g. model.state_dict())",
        )
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise ConfigError("state dict keys must be tensor names (str)", key=repr(name))
        dtype = getattr(value, "dtype", None)
        if type(value).__module__.startswith("torch"):
            device = getattr(value, "device", None)
            if device is not None and device.type == "meta":
                raise ConfigError(
                    f"tensor {name!r} is on the meta device: it has no values",
                    hint="materialise the model's weights before publishing",
                )
            layout = str(getattr(value, "layout", "torch.strided")).removeprefix("torch.")
            if layout != "strided":
                raise ConfigError(
                    f"tensor {name!r} is {layout}, not dense", hint="publish dense tensors"
                )
        name_of = str(dtype).removeprefix("torch.") if dtype is not None else None
        if name_of is not None and getattr(dtype, "name", name_of) not in _MASTER_DTYPES:
            raise ConfigError(
                f"cannot publish {name_of} tensor {name!r}",
                hint="publish float32/bfloat16/float16 parameters only; leave "
                "buffers and integer tensors out of the state dict",
            )


def snapshot_state(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Host copies of every tensor (numpy or torch on any device) that nothing else shares."""
    out: dict[str, np.ndarray] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise ConfigError("state dict keys must be tensor names (str)", key=repr(name))
        arr = to_numpy(value)
        on_device = not isinstance(value, np.ndarray) and value.device.type != "cpu"
        if arr.dtype.name not in _MASTER_DTYPES:
            raise ConfigError(
                f"cannot publish {arr.dtype.name} tensor {name!r}",
                hint="publish float32/bfloat16/float16 parameters only; leave "
                "buffers and integer tensors out of the state dict",
            )
        out[name] = arr if on_device else np.array(arr, copy=True, order="C")
    return out


def snapshot_served(
    state_dict: Mapping[str, Any], config: PublisherConfig, pool: WordPool | None = None
) -> View:
    """The served view of ``state_dict``, cast tensor by tensor: the snapshot holds the served
    bits (a BF16 view is half the FP32 masters), and no host copy of the masters is ever
    whole (one tensor's at a time, only for masters off the CPU).

    Masters all on the CPU are cast on :func:`rollpatch.native.threads` threads, tensors at
    once (the cast is numpy in cache-sized chunks, which releases the GIL): the trainer's
    call and the version's time to LATEST shrink with the free cores; the bits are the same.
    ``pool``: where the BF16 words of a torch cast are written (buffers of earlier snapshots
    that nothing references any more, already paged in; :mod:`.wordpool`)."""

    fmt = get_format(config.format)
    torch_cast = _torch_cast()
    plain_meta = dict(cast_view({}, fmt, scales=config.scales).metadata)

    def cast_one(item: tuple[str, Any]) -> View:
        name, value = item
        one = snapshot_state({name: value}) if _off_cpu(value) else None
        arr = one[name] if one is not None else _host_master(name, value)
        if (
            torch_cast is not None
            and fmt.plain_kind == "bf16"
            and torch_cast.castable(arr)
            and not fmt.quantises(name, arr.shape, config.policy)
        ):  # one torch pass, bit for bit formats' cast (publisher/cast.py)
            out = None if pool is None else pool.take(name, arr.size)
            words = torch_cast.host_words(arr, out)
            return View({name: Tensor(KINDS["bf16"], arr.shape, words)}, plain_meta)
        part = cast_view({name: arr}, config.format, policy=config.policy, scales=config.scales)
        # the trainer may change its tensors as soon as publish() returns
        return View(
            {k: t.copy() if np.shares_memory(t.data, arr) else t for k, t in part.items()},
            part.metadata,
        )

    items = list(state_dict.items())
    small = sum(_n_elements(v) for _, v in items) < _THREADED_CAST_MIN
    if small or any(_off_cpu(v) for _, v in items):  # one host copy at a time off the CPU
        parts = [cast_one(x) for x in items]
    else:
        parts = native.parallel_map(cast_one, items)
    out: dict[str, Tensor] = {}
    meta: dict[str, str] = {}
    for part in parts:
        meta = dict(part.metadata)
        for served, t in part.items():
            if served in out:
                raise FormatError(
                    "two master tensors produce the same served name",
                    tensor=served,
                    format=config.format,
                )
            out[served] = t
    if not meta:
        meta = dict(cast_view({}, config.format, scales=config.scales).metadata)
    return View(out, meta)


def _torch_cast() -> ModuleType | None:
    """:mod:`.cast` when this process has imported torch (every trainer has): importing it
    for a numpy caller would cost seconds and hundreds of MB for a cast numpy also does."""
    if "torch" not in sys.modules:
        return None
    from . import cast

    return cast


def _n_elements(value: Any) -> int:
    """Elements of a numpy array or torch tensor (0 for anything else: refused later)."""
    if isinstance(value, np.ndarray):
        return int(value.size)
    numel = getattr(value, "numel", None)
    return int(numel()) if callable(numel) else 0


def _off_cpu(value: Any) -> bool:
    device = getattr(value, "device", None)
    return not isinstance(value, np.ndarray) and device is not None and device.type != "cpu"


def _host_master(name: str, value: Any) -> np.ndarray:
    """A CPU tensor as numpy (no copy), checked like :func:`snapshot_state`."""
    if not isinstance(name, str):
        raise ConfigError("state dict keys must be tensor names (str)", key=repr(name))
    arr = to_numpy(value)
    if arr.dtype.name not in _MASTER_DTYPES:
        raise ConfigError(
            f"cannot publish {arr.dtype.name} tensor {name!r}",
            hint="publish float32/bfloat16/float16 parameters only; leave "
            "buffers and integer tensors out of the state dict",
        )
    return arr


class VersionWriter:
    """This rank's side of publishing versions: its shard pipeline (host or device), the
    roots of recent versions (for skip patches) and the resume from the board's newest one."""

    def __init__(
        self,
        board: Board,
        run: str,
        config: PublisherConfig,
        x: Exchange,
        resume_from: int | None,
        resume_target: str,
    ) -> None:
        self.board, self.run, self.config, self._x = board, run, config, x
        self.resume_from = resume_from
        self.roots: dict[int, str] = {} if resume_from is None else {resume_from: resume_target}
        self.pipe = ShardPipeline(board, run, config, x.rank)
        #: The diff runs on the masters' devices (None: ``diff_on="auto"``, not decided yet).
        self.on_device: bool | None = {"host": False, "device": True}.get(config.diff_on)
        if self.on_device:
            self.pipe = _device_pipeline(board, run, config, x.rank)
        #: How the last resume rebuilt this rank's base: "shard" (its own objects only),
        #: "whole" (every shard), or None (no resume yet).
        self.resume_scope: str | None = None
        #: Rank 0: the sliced layout of the last version (None: read from the parent).
        self._layout: dict[str, tuple[object, ...]] | None = None

    def decide_device(self, state_dict: Mapping[str, Any]) -> bool:
        """Where the diff runs; ``diff_on="auto"``: the first state dict decides."""
        if self.on_device is None:
            self.on_device = any(
                type(v).__module__.startswith("torch") and v.device.type != "cpu"
                for v in state_dict.values()
            )
            if self.on_device:
                self.pipe = _device_pipeline(self.board, self.run, self.config, self._x.rank)
        return self.on_device

    def publish(
        self, snap: Snapshot, parent: int | None, forced_keyframe: bool, started: float
    ) -> VersionStats:
        """Publish ``snap`` on top of ``parent`` (every rank calls this for the same version);
        raises this rank's error, or :class:`BoardError` naming another rank's."""
        n, k = snap.version, self.config.keyframe_every
        keyframe = forced_keyframe or parent is None or (k > 0 and n // k != parent // k)
        resume_s = 0.0
        res: ShardResult | None = None
        local: BaseException | None = None
        try:
            if self.resume_from is not None and self.pipe.prev is None:
                t = time.perf_counter()
                base = self._resumed_view(snap)
                resume_s = time.perf_counter() - t
                if base is None:  # no sound path to it: this version is a fresh keyframe
                    parent, keyframe = None, True
                else:
                    self.pipe.resume(self.resume_from, base, sharded=self._x.size > 1)
            if snap.error is not None:
                raise snap.error
            self.pipe.slices = snap.slices
            res = self.pipe.build(n, snap.masters, keyframe=keyframe)
            message: dict[str, Any] = res.message()
        except Exception as e:  # noqa: BLE001 (told to the other ranks, then re-raised)
            local, message = e, {"ok": False, "error": f"{type(e).__name__}: {e}"}
        t_commit = time.perf_counter()
        messages = self._x.allgather(message)
        outcome: dict[str, Any] = {}
        if self._x.rank == 0:
            outcome, err = self._write_manifest(snap, parent, keyframe, messages)
            local = local or err
        outcome = self._x.allgather(outcome)[0]
        if local is not None:
            raise local
        if not outcome.get("ok"):
            raise BoardError(
                f"publishing failed on another rank: {outcome.get('error')}",
                run=self.run,
                version=n,
            )
        assert res is not None
        stats = self._record(snap, res, parent, started, resume_s, t_commit, outcome)
        self.pipe.commit(res)  # after the stats: total_s ends when LATEST names the version
        return stats

    def _resumed_view(self, snap: Snapshot) -> View | None:
        """The resumed version's view as this rank's base: its own shard only when the board
        has it in the same layout (``keyframe.reconstruct_shard``), else the whole view.

        None when an unsharded publisher finds no sound path to it (objects corrupt on the
        store, with no way around: an attacker or a bad disk can do that, and a publisher
        that could not resume would never publish again); the version then starts a new
        lineage from a keyframe (``parent`` None). Ranks of a sharded publisher must agree
        on that, which they have no round for: they raise instead."""
        assert self.resume_from is not None
        signer = self.config.signer
        trust = None if signer is None else signer.self_trust()
        if self._x.size > 1:
            part = reconstruct_shard(
                self.board, self.run, self.resume_from, self._x.rank, self._x.size, trust=trust
            )
            if (
                part is not None
                and shard_matches(part, snap.masters, self.config.format)
                and all(part[k].shape == s.local_shape for k, s in snap.slices.items())
            ):
                self.resume_scope = "shard"
                return part
        self.resume_scope = "whole"
        try:
            return reconstruct(self.board, self.run, self.resume_from, trust=trust)
        except (ObjectIntegrityError, NoPathError) as e:
            if self._x.size > 1:
                raise
            log.warning(
                "%s: cannot rebuild version %d from sound objects (%s: %s); version %d "
                "is published as a keyframe with no parent",
                self.run,
                self.resume_from,
                type(e).__name__,
                e,
                snap.version,
            )
            self.resume_scope = "keyframe"
            return None

    def _write_manifest(
        self, snap: Snapshot, parent: int | None, keyframe: bool, messages: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], BaseException | None]:
        bad = [(r, m) for r, m in enumerate(messages) if not m.get("ok")]
        if bad:
            return {"ok": False, "error": f"rank {bad[0][0]}: {bad[0][1].get('error')}"}, None
        try:
            meta = {"step": str(snap.step), "scales": self.config.scales}
            if self._layout is None and parent is not None:
                pm = self.board.manifest(self.run, parent)
                self._layout = {t.name: t.layout() for t in pm.sliced}
            m = assemble_manifest(
                run=self.run,
                version=snap.version,
                parent=parent,
                keyframe=keyframe,
                messages=messages,
                root_digests=self.roots,
                config=self.config,
                meta=meta,
                layout=self._layout,
            )
            self.board.put_manifest(m)
            self.board.advance(self.run, snap.version)
            self._layout = {t.name: t.layout() for t in m.sliced}
        except Exception as e:  # noqa: BLE001 (told to the other ranks, then re-raised)
            return {"ok": False, "error": f"rank 0: {type(e).__name__}: {e}"}, e
        skip_bases = sorted({p.base for p in m.patches} - {parent})
        return {
            "ok": True,
            "target": m.target,
            "skip_bases": skip_bases,
            "keyframe": m.is_keyframe,
        }, None

    def _record(
        self,
        snap: Snapshot,
        res: ShardResult,
        parent: int | None,
        started: float,
        resume_s: float,
        t_commit: float,
        outcome: dict[str, Any],
    ) -> VersionStats:
        now = time.perf_counter()
        n = snap.version
        self.roots[n] = outcome["target"]
        horizon = n - self.config.window  # the oldest base a skip or folded patch may need
        for v in [v for v in self.roots if v < horizon]:
            del self.roots[v]
        return VersionStats(
            version=n,
            parent=parent,
            keyframe=bool(outcome["keyframe"]),
            skip_bases=tuple(outcome["skip_bases"]),
            snapshot_s=snap.snapshot_s,
            call_return_s=snap.call_return_s if snap.call_return_s is not None else now - snap.t0,
            queue_s=max(0.0, started - snap.t0 - snap.snapshot_s),
            resume_s=resume_s,
            commit_s=now - t_commit,
            total_s=now - snap.t0,
            bytes=res.bytes,
            patch_bytes=res.patch_bytes,
            changed=res.changed,
            tensors_dropped=res.dropped,
            tensors_whole=res.whole,
            host_bytes=res.host_bytes,
            **{k: res.timings.get(k, 0.0) for k in ("cast_s", "diff_s", "encode_s", "upload_s")},
        )


def _device_pipeline(board: Board, run: str, config: PublisherConfig, shard: int) -> ShardPipeline:
    try:
        from .devpipe import DeviceShardPipeline
    except ImportError as e:
        raise ConfigError(
            "PublisherConfig(diff_on='device') needs torch",
            hint="pip install 'rollpatch[torch]', or use diff_on='host'",
        ) from e
    return DeviceShardPipeline(board, run, config, shard)
