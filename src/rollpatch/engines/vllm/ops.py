"""The worker extension's operations on a :class:`RuntimeWeights` (numpy only, no torch).

Each takes string arguments (only strings cross ``/collective_rpc``) and returns a JSON-able
dict; :func:`run_op_on` turns errors into ``{"ok": False, "error": ...}``. Staging
(``stage``/``staged``/``commit``/``discard``) decodes, composes and proves a chain of
published steps against the held words in a background thread at TP = 1, so vLLM keeps
serving; the commit, under the caller's pause, only writes (docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, ManifestError, error_report
from ...io.safetensors import load_view, save_view
from ...patch import Patch, compose, decode, inspect
from ...patch.header import MIN_FULL_BOUND
from ...patch.overlay import Overlay
from ...view import View, sum_add
from ..catchup import decode_in_place
from ..staged import StagedUpdate
from .layout import locate
from .memtrace import MemTrace, trim
from .tpdecode import decode_chain_split, decode_split
from .transfer import read_decoded
from .weights import RuntimeWeights
from .writes import WriteMode

__all__ = ["OPS", "check_owner", "require_fault_injection", "run_op_on"]

_MAX_STEPS = 4096
_MAX_JOBS = 8


def _chain(
    w: RuntimeWeights, steps: list[dict[str, Any]], *, timings: dict[str, float] | None = None
) -> tuple[Patch, dict[str, Any], dict[str, Any]]:
    """Decode a chain of steps against the held words and compose it: in place in one copy
    per touched tensor (:mod:`rollpatch.engines.catchup`), else step *k* against an :class:`Overlay` of the
    words and steps 1..k-1 (a tensor copy at a time, per step). Also returns the target
    rp.sum128 states the in-place decoder proved (empty from the overlay path), and at TP > 1
    the rp.sum128 changes the ranks that decoded each tensor measured over the words they
    read (:mod:`.tpdecode`; ``stage_patch(vouched=)``), summed over the steps. ``timings``:
    where a split decode adds its phases, ms (``gather_ms``, ``own_decode_ms``, ``share_ms``)."""
    if w.root() != steps[0]["base"]:  # decoding against another base would read wrong contexts
        raise BaseMismatchError(
            "engine root digest is not the patch's base",
            expected=str(steps[0]["base"])[:16],
            actual=w.root()[:16],
            hint="the engine is on another version; plan a new path",
        )
    blobs = [[Path(p).read_bytes() for p in step["paths"]] for step in steps]
    if w.tp == 1:  # each touched tensor copied once, every step decoded into the copy
        composed = decode_in_place(w, steps, blobs, w.state_of)
        if composed is not None:
            return (*composed, {})
    elif w.splits_decoding and len(steps) > 1:  # the same per tensor, on the rank owning it
        chained = decode_chain_split(w, steps, blobs, timings=timings)
        if chained is not None:
            return chained[0], {}, chained[1]
    patch: Patch | None = None
    vouched: dict[str, Any] = {}
    unvouched: set[str] = set()  # touched by a step whose change no rank measured
    serial = w.tp > 1  # TP > 1: one gathered tensor at a time, with the full ops bounded
    limit = max(MIN_FULL_BOUND, w.nbytes) if serial else None
    alone = len(steps) == 1  # no later step decodes against it: each rank its blocks only
    for step, parts in zip(steps, blobs, strict=True):
        tensors: dict[str, Any] = {}
        digest = None
        for blob in parts:
            # TP > 1: reading a tensor is a collective, so tensors are read one after another
            # in an order every rank knows, each just before it is decoded: one gathered
            # tensor in memory at a time, not every touched tensor at once; each decoded by
            # one rank and shared where the ranks can (.tpdecode), else by every rank
            if w.splits_decoding:
                assert limit is not None
                part, changes = decode_split(w, blob, patch, limit, timings=timings, blocks=alone)
                for name in part.tensors:
                    if name in changes:
                        vouched[name] = sum_add(vouched.get(name, (0, 0)), changes[name])
                    else:
                        unvouched.add(name)
            else:
                base: Any = w if patch is None else Overlay(w, patch)
                part = decode(
                    blob, base, check_base=False, parallel=not serial, max_full_bytes=limit
                )
            if len(parts) == 1 and (part.base, part.target) != (step["base"], step["target"]):
                raise ManifestError("patch object binds other digests than its step")
            if tensors.keys() & part.tensors.keys():
                raise ManifestError("patch shards overlap")
            tensors.update(part.tensors)
            digest = part.digest
        one = Patch(step["base"], step["target"], tensors, digest=digest or "rp.sum128.v1")
        patch = one if patch is None else compose(patch, one)
    assert patch is not None
    return patch, {}, {n: c for n, c in vouched.items() if n not in unvouched}


def _read_spec(path: str) -> tuple[str, list[dict[str, Any]], bool, WriteMode, bool]:
    """The staging request: token, steps, prebuild kernels, write mode, in a thread."""
    try:
        spec = json.loads(Path(path).read_text())
        token, steps, prepack = spec["token"], spec["steps"], spec.get("prepack", "stage")
        mode, where = spec.get("writes", "in_place"), spec.get("staging", "thread")
        ok = (
            prepack in ("stage", "pause")
            and mode in ("in_place", "double_buffer")
            and where in ("thread", "inline")
            and isinstance(token, str)
            and 0 < len(token) <= 64
            and isinstance(steps, list)
            and 0 < len(steps) <= _MAX_STEPS
            and all(
                isinstance(st, dict)
                and isinstance(st.get("base"), str)
                and isinstance(st.get("target"), str)
                and isinstance(st.get("paths"), list)
                and 0 < len(st["paths"]) <= _MAX_STEPS
                and all(isinstance(p, str) for p in st["paths"])
                for st in steps
            )
        )
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise EngineError("invalid staging request", path=path)
    return token, steps, prepack == "stage", mode, where == "thread"


class _Job:
    """One staging run; in a thread at TP = 1 (the engine keeps serving), inline otherwise."""

    def __init__(
        self, w: RuntimeWeights, steps: list[dict[str, Any]], prebuild: bool, mode: WriteMode
    ) -> None:
        self.staged: StagedUpdate | None = None
        self.error: dict[str, Any] | None = None
        self.ms = 0.0
        self.phases: dict[str, float] = {}
        self.memory: dict[str, float] = {}  # resident MiB by phase (:class:`.memtrace.MemTrace`)
        self.cores = 0  # the cores the staging thread ran on (0: not changed)
        self.done = threading.Event()
        self._w, self._steps, self._prebuild, self._mode = w, steps, prebuild, mode

    def run(self, beside: bool = False) -> None:
        """Stage; ``beside``: in a thread beside the engine loop (at TP > 1 its gathers then
        go through a group of their own: ``Access.own_collectives``)."""
        own = self._w.access.own_collectives
        if self._w.tp == 1 and beside:  # never the engine loop's own thread: vLLM binds it
            self.cores = widen_cores()
        scope = own() if beside and self._w.tp > 1 and own is not None else nullcontext()
        with scope:
            res = run_op_on(self._w, lambda w: self._stage(w))
        self.ms = res["ms"]
        if not res["ok"]:
            self.error = res["error"]
        self.done.set()

    def _stage(self, w: RuntimeWeights) -> dict[str, Any]:
        w.settler.wait()  # the last commit's words and frees first (staging reads the words)
        with MemTrace() as mem:
            t0 = time.perf_counter()
            split: dict[str, float] = {}  # TP > 1: the decode's split between the ranks
            patch, known, vouched = _chain(w, self._steps, timings=split)
            decode_ms = (time.perf_counter() - t0) * 1e3
            mem.mark("decode")
            trim()  # the decoder threads' scratch and per-step arrays, freed in their arenas
            self.staged = w.stage(
                patch,
                prebuild=self._prebuild,
                known=known,
                vouched=vouched,
                mode=self._mode,
                consume=True,
                mark=mem.mark,
            )
            del patch, known, vouched
        self.phases = {"decode_ms": decode_ms, **split, **w.last_stage_phases}
        if self.cores:
            self.phases["cores"] = float(self.cores)
        self.memory = mem.report()
        return {}


def widen_cores() -> int:
    """Let the calling thread (and the threads it starts) run on every core of the machine;
    returns how many it may use now (0 where the platform cannot say or refuses).

    vLLM's CPU worker binds itself and all its threads to the cores its OpenMP threads run
    the forward passes on (``VLLM_CPU_OMP_THREADS_BIND=auto``: core 0 of two here), so a
    staging thread started there decodes on the forward passes' core only, one thread wide
    (:func:`rollpatch.native.threads` counts the calling thread's cores). Staging is off the
    forward path and bounded in time; on every core the scheduler gives it the cores the
    forward passes leave idle. Linux: the affinity of the calling thread only."""
    if not hasattr(os, "sched_setaffinity"):
        return 0
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        return len(os.sched_getaffinity(0))
    except OSError:
        return 0


def _stage(w: RuntimeWeights, path: str) -> dict[str, Any]:
    token, steps, prebuild, mode, thread = _read_spec(path)
    while len(w.jobs) >= _MAX_JOBS:
        w.jobs.pop(next(iter(w.jobs)))
    job = w.jobs[token] = _Job(w, steps, prebuild, mode)
    # TP > 1: reading a tensor is a collective; in a thread only where its gathers have a
    # group of their own (.tpgather), else on the engine loop (as when asked: "inline")
    background = thread and (w.tp == 1 or w.access.own_collectives is not None)
    if background:
        threading.Thread(target=job.run, args=(True,), daemon=True, name="rollpatch-stage").start()
    else:
        job.run()
    return {"token": token, "background": background}


def _job(w: RuntimeWeights, token: str) -> _Job:
    job = w.jobs.get(token)
    if job is None:
        raise EngineError("no staged update with this token", token=token)
    return job


def _staged(w: RuntimeWeights, token: str) -> dict[str, Any]:
    job = _job(w, token)
    if not job.done.is_set():
        return {"state": "staging"}
    if job.error is not None:
        w.jobs.pop(token, None)
        return {"state": "failed", "failure": job.error}
    st = job.staged
    assert st is not None
    return {
        "state": "ready",
        "base": st.base,
        "target": st.target,
        "changed": st.changed,
        "nbytes": st.nbytes,
        "digests": st.digests,
        "stage_ms": job.ms,
        "stage_phases": job.phases,
        "stage_memory": job.memory,
    }


def _commit(w: RuntimeWeights, token: str) -> dict[str, Any]:
    job = _job(w, token)
    if not job.done.is_set() or job.staged is None:
        raise EngineError("the update is not staged", token=token)
    w.jobs.pop(token, None)
    # undoable at TP > 1 under the token (the same on every rank): RuntimeWeights.undo_last
    digests = w.commit_staged(job.staged, undo_key=token)
    return {"digests": digests, "root": w.root(), "phases": w.last_phases}


def _settled(w: RuntimeWeights) -> dict[str, Any]:
    """Wait for the words written after the last pause (:mod:`.writes`); their batch."""
    w.settler.wait()
    return {"settle": dict(w.settler.last), "tainted": w.tainted}


def _audit(w: RuntimeWeights, budget: str) -> dict[str, Any]:
    r = w.audit(int(budget))
    return {
        "tensors": r.tensors,
        "bytes": r.nbytes,
        "mismatched": list(r.mismatched),
        "wrapped": r.wrapped,
        "tainted": w.tainted,
    }


def require_fault_injection() -> None:
    """Refuse fault injection unless the server was started with it enabled."""
    if os.environ.get("ROLLPATCH_FAULT_INJECTION") != "1":
        raise EngineError(
            "fault injection is off",
            hint="start vLLM with ROLLPATCH_FAULT_INJECTION=1 (drills and tests only)",
        )


def _flip(w: RuntimeWeights, name: str, position: int) -> dict[str, Any]:
    require_fault_injection()
    pl = w.placement(name)
    w.settler.wait()
    _, offsets = locate(pl, np.array([position], np.int64))
    if offsets.size:
        acc = w.access
        assert acc.prepare is not None and acc.read_at is not None and acc.scatter is not None
        prepared = acc.prepare(pl.param, offsets)
        acc.scatter(pl.param, prepared, acc.read_at(pl.param, prepared) ^ 1)
        acc.repack({pl.param})
    return {"flipped": int(offsets.size)}


def _apply_encoded(w: RuntimeWeights, path: str) -> dict[str, Any]:
    header = inspect(Path(path).read_bytes())
    patch, known, vouched = _chain(
        w, [{"base": header.base, "target": header.target, "paths": [path]}]
    )
    staged = w.stage(patch, known=known, vouched=vouched, consume=True)
    return {"digests": w.commit_staged(staged, undo_key=path), "root": w.root()}


def _claim(w: RuntimeWeights, owner: str) -> dict[str, Any]:
    """An adapter's first call: it becomes the owner (refused while another one calls,
    :mod:`rollpatch.engines.ownership`). Taking over from one that fell silent gives the state
    a new identity and drops its staged updates: what that adapter verified is void."""
    if not owner:
        raise EngineError("a claim needs the adapter's owner token")
    if w.ownership.claim(owner):
        w.boot = secrets.token_hex(8)
        w.jobs.clear()
    return {"owner": owner}


def check_owner(w: RuntimeWeights, owner: str) -> None:
    """An adapter's call (``owner``: its token) is refused unless it is the owner's. A state
    no adapter holds (a restarted engine's, or one whose owner closed) becomes the caller's:
    its audit then finds the identity changed. Calls without a token (tools, tests, drills
    through ``/collective_rpc``) are not checked."""
    if not owner:
        return
    if w.ownership.owner is None:
        w.ownership.claim(owner)
    else:
        w.ownership.check(owner)


def _export(w: RuntimeWeights, name: str, path: str) -> dict[str, Any]:
    t = w[name]
    if w.rank == 0:
        save_view(View({name: t}), path)
    return {"bytes": t.nbytes}


OPS: dict[str, Callable[[RuntimeWeights, str, str], dict[str, Any]]] = {
    "apply_encoded": lambda w, path, _: _apply_encoded(w, path),
    "stage": lambda w, path, _: _stage(w, path),
    "staged": lambda w, token, _: _staged(w, token),
    "commit": lambda w, token, _: _commit(w, token),
    "discard": lambda w, token, _: {"discarded": w.jobs.pop(token, None) is not None},
    "undo": lambda w, key, _: {"undone": bool(key) and w.undo_last(key)},
    "settled": lambda w, _a, _b: _settled(w),
    "audit": lambda w, budget, _: _audit(w, budget),
    "flip": lambda w, name, position: _flip(w, name, int(position)),
    "apply": lambda w, path, _: {
        "digests": w.commit(read_decoded(path), undo_key=path),
        "root": w.root(),
    },
    "load": lambda w, path, _: {"root": w.load(load_view(path, mmap=True))},
    "digest": lambda w, fresh, _: {
        "digests": w.digests(fresh=fresh == "1"),
        "root": w.root(),
        "tainted": w.tainted,
    },
    "export": lambda w, name, path: _export(w, name, path),
    "claim": lambda w, owner, _: _claim(w, owner),
    "disown": lambda w, _a, _b: w.ownership.disown(),
    "info": lambda w, _a, _b: {
        "rank": w.rank,
        "tp": w.tp,
        "aliases": w.access.aliases,
        # staging in a thread while the engine serves (at TP > 1: where .tpgather allows)
        "background_staging": w.tp == 1 or w.access.own_collectives is not None,
        "tensors": {n: [w.kind_of(n).name, list(w.placement(n).shape)] for n in w.names()},
    },
}


def run_op_on(w: Any, fn: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """``fn(w)`` as a JSON-able result: ``ok`` plus its dict, or ``error``; with ``ms``."""
    t0 = time.perf_counter()
    try:
        out = {"ok": True, **fn(w)}
    except Exception as err:  # noqa: BLE001 - reported to the adapter (errors.engine_error)
        out = {"ok": False, "error": error_report(err)}
    out["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    return out
