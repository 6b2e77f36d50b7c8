"""vLLM side: the worker extension that holds a served view inside stock vLLM.

Start vLLM with ``--worker-extension-cls rollpatch.engines.vllm.WorkerExtension`` (and,
for the official weight-update routes, ``--weight-transfer-config '{"backend": "rollpatch"}'``).
Importing this module inside a vLLM process does two things, before the model loads:

- on the CPU platform, wraps ``dispatch_cpu_unquantized_gemm`` so it always keeps the plain
  weight (``remove_weight=False``) and remembers how to rebuild the packed one: the CPU backend
  otherwise copies each linear weight into an opaque oneDNN buffer and empties
  ``layer.weight``, leaving nothing to read digests from or patch in place;
- registers the ``rollpatch`` weight-transfer backend (lazily, by module path).

It imports neither torch nor vLLM itself: where vLLM is not already imported (a sidecar, a
type checker) it does nothing. Every method returns a JSON-able dict (``ok`` plus results, or
``error`` with the rollpatch exception class, message and context) because only those cross
``/collective_rpc`` intact.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, ManifestError, RollpatchError
from ...io.safetensors import load_view, save_view
from ...patch import Patch, compose, decode, inspect
from ...patch.overlay import Overlay
from ...view import View
from ..staged import StagedUpdate
from .layout import storage_offsets
from .transfer import read_decoded
from .weights import Access, RuntimeWeights

__all__ = ["BACKEND", "WorkerExtension", "run_op"]

#: The weight-transfer backend name (``--weight-transfer-config '{"backend": "rollpatch"}'``).
BACKEND = "rollpatch"
_STATE = "_rollpatch_weights"
_WORDS = {2: (np.int16, np.uint16), 4: (np.int32, np.uint32)}


def _keep_plain_weights() -> None:
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_rollpatch", False):
        return

    def dispatch(layer: Any, remove_weight: bool) -> None:
        original(layer, remove_weight=False)
        layer._rollpatch_repack = original  # rebuilt after every write to layer.weight

    dispatch._rollpatch = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch


def _register_backend() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rollpatch.engines.vllm.backend", "RollpatchTransferEngine")


if "vllm" in sys.modules:  # inside vLLM: install before the model loads
    _keep_plain_weights()
    _register_backend()


def _modules(model: Any, params: set[str]) -> list[Any]:
    """The modules owning ``params``, each once (weight and bias share one packed buffer)."""
    names = sorted({p.rpartition(".")[0] for p in params})
    return [model.get_submodule(n) if n else model for n in names]


def _access(model: Any, tp: int, *, alias: bool | None = None) -> Access:
    """Numpy views of the parameters on the CPU (``alias``, the default there); host copies
    and torch writes elsewhere (GPU; ``alias=False`` exercises that path on the CPU)."""
    import torch

    params = dict(model.named_parameters())
    cpu = all(p.device.type == "cpu" for p in params.values()) if alias is None else alias

    def shape2(p: Any) -> tuple[int, int]:
        rows = int(p.shape[0]) if p.dim() else 1
        return rows, int(p.numel()) // max(rows, 1)

    def words(p: Any) -> Any:
        return p.detach().view(getattr(torch, f"int{8 * p.element_size()}"))

    views: dict[str, np.ndarray] = {}
    if cpu:
        for name, p in params.items():
            a = words(p).numpy().view(_WORDS[p.element_size()][1]).reshape(shape2(p))
            if a.size and a.__array_interface__["data"][0] != p.data_ptr():
                raise EngineError("parameter words do not alias the parameter", param=name)
            views[name] = a

    def read(name: str) -> np.ndarray:
        if cpu:
            return views[name]
        p = params[name]
        host = words(p).cpu().contiguous().numpy()
        return host.view(_WORDS[p.element_size()][1]).reshape(shape2(p))

    def flat(name: str) -> tuple[np.ndarray, list[int]]:
        a = views[name]
        elem = [s // a.itemsize for s in a.strides]
        span = 1 + sum((n - 1) * s for n, s in zip(a.shape, elem))
        return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,)), elem

    def prepare(name: str, offsets: np.ndarray) -> np.ndarray:
        """CPU: storage offsets (stride-aware), computed before the pause."""
        if not cpu:
            return offsets
        return storage_offsets(offsets, views[name].shape, flat(name)[1])

    def device_index(p: Any, offsets: np.ndarray) -> tuple[Any, Any]:
        r, c = np.divmod(offsets, shape2(p)[1])
        return torch.from_numpy(r).to(p.device), torch.from_numpy(c).to(p.device)

    def scatter(name: str, prepared: np.ndarray, values: np.ndarray) -> None:
        p = params[name]
        if cpu:
            flat(name)[0][prepared] = values
            return
        signed = values.view(_WORDS[p.element_size()][0])
        w = words(p).view(shape2(p))  # a view (never a copy); indexing it is stride-aware
        w.index_put_(device_index(p, prepared),
                     torch.from_numpy(np.ascontiguousarray(signed)).to(p.device))

    def read_at(name: str, prepared: np.ndarray) -> np.ndarray:
        p = params[name]
        if cpu:
            return flat(name)[0][prepared]
        got = words(p).view(shape2(p))[device_index(p, prepared)].cpu().numpy()
        return got.view(_WORDS[p.element_size()][1])

    def write(name: str, offsets: np.ndarray, values: np.ndarray) -> None:
        scatter(name, prepare(name, offsets), values)

    def write_block(name: str, index: tuple[slice, slice], block: np.ndarray) -> None:
        p = params[name]
        if cpu:
            views[name][index] = block
            return
        signed = np.ascontiguousarray(block).view(_WORDS[p.element_size()][0])
        words(p).view(shape2(p))[index] = torch.from_numpy(signed).to(p.device)

    def repack(names: set[str]) -> None:
        with torch.no_grad():
            for mod in _modules(model, names):
                rebuild = getattr(mod, "_rollpatch_repack", None)
                if rebuild is not None:
                    rebuild(mod, remove_weight=False)

    def gather(name: str, local: np.ndarray) -> list[np.ndarray]:
        from vllm.distributed import get_tp_group

        p = params[name]
        t = torch.from_numpy(np.ascontiguousarray(local).view(_WORDS[p.element_size()][0]))
        out = get_tp_group().all_gather(t.reshape(-1).to(p.device), dim=0)
        return [c.cpu().numpy().view(local.dtype).reshape(local.shape)
                for c in out.chunk(tp)]

    return Access(read, write, write_block, repack, gather if tp > 1 else None, aliases=cpu,
                  prepare=prepare, scatter=scatter, read_at=read_at)


def weights_of(model: Any) -> RuntimeWeights:
    """The model's :class:`RuntimeWeights`, built once (from the model's own metadata)."""
    state = getattr(model, _STATE, None)
    if state is None:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        from .describe import describe

        rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        specs, kinds = describe(model, rank, tp)
        state = RuntimeWeights(specs, kinds, _access(model, tp), rank=rank, tp=tp)
        object.__setattr__(model, _STATE, state)
    return state


_MAX_STEPS = 4096
_MAX_JOBS = 8


def _chain(w: RuntimeWeights, steps: list[dict[str, Any]]) -> Patch:
    """Decode a chain of steps against the held words and compose it (step *k* is decoded
    against an :class:`Overlay` of the words and steps 1..k-1: a tensor copy at a time)."""
    if w.root() != steps[0]["base"]:  # decoding against another base would read wrong contexts
        raise BaseMismatchError("engine root digest is not the patch's base",
                                expected=str(steps[0]["base"])[:16], actual=w.root()[:16],
                                hint="the engine is on another version; plan a new path")
    patch: Patch | None = None
    for step in steps:
        parts = [Path(p).read_bytes() for p in step["paths"]]
        names = sorted({e["name"] for blob in parts for e in inspect(blob).tensors})
        base: Any = w if patch is None else Overlay(w, patch)
        if w.tp > 1:  # reading a tensor is a collective: read them in one order on every rank
            base = View({n: base[n] for n in names if n in base})
        tensors: dict[str, Any] = {}
        digest = None
        for blob in parts:
            part = decode(blob, base, check_base=False)
            if len(parts) == 1 and (part.base, part.target) != (step["base"], step["target"]):
                raise ManifestError("patch object binds other digests than its step")
            if tensors.keys() & part.tensors.keys():
                raise ManifestError("patch shards overlap")
            tensors.update(part.tensors)
            digest = part.digest
        one = Patch(step["base"], step["target"], tensors, digest=digest or "rp.sum128.v1")
        patch = one if patch is None else compose(patch, one)
    assert patch is not None
    return patch


def _read_spec(path: str) -> tuple[str, list[dict[str, Any]]]:
    try:
        spec = json.loads(Path(path).read_text())
        token, steps = spec["token"], spec["steps"]
        ok = (isinstance(token, str) and 0 < len(token) <= 64 and isinstance(steps, list)
              and 0 < len(steps) <= _MAX_STEPS
              and all(isinstance(st, dict) and isinstance(st.get("base"), str)
                      and isinstance(st.get("target"), str) and isinstance(st.get("paths"), list)
                      and 0 < len(st["paths"]) <= _MAX_STEPS
                      and all(isinstance(p, str) for p in st["paths"]) for st in steps))
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise EngineError("invalid staging request", path=path)
    return token, steps


class _Job:
    """One staging run; in a thread at TP = 1 (the engine keeps serving), inline otherwise."""

    def __init__(self, w: RuntimeWeights, steps: list[dict[str, Any]]) -> None:
        self.staged: StagedUpdate | None = None
        self.error: dict[str, Any] | None = None
        self.ms = 0.0
        self.done = threading.Event()
        self._w, self._steps = w, steps

    def run(self) -> None:
        res = run_op_on(self._w, lambda w: self._stage(w))
        self.ms = res["ms"]
        if not res["ok"]:
            self.error = res["error"]
        self.done.set()

    def _stage(self, w: RuntimeWeights) -> dict[str, Any]:
        self.staged = w.stage(_chain(w, self._steps))
        return {}


def _stage(w: RuntimeWeights, path: str) -> dict[str, Any]:
    token, steps = _read_spec(path)
    while len(w.jobs) >= _MAX_JOBS:
        w.jobs.pop(next(iter(w.jobs)))
    job = w.jobs[token] = _Job(w, steps)
    if w.tp > 1:
        job.run()
    else:
        threading.Thread(target=job.run, daemon=True, name="rollpatch-stage").start()
    return {"token": token, "background": w.tp == 1}


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
    return {"state": "ready", "base": st.base, "target": st.target, "changed": st.changed,
            "nbytes": st.nbytes, "digests": st.digests, "stage_ms": job.ms}


def _commit(w: RuntimeWeights, token: str) -> dict[str, Any]:
    job = _job(w, token)
    if not job.done.is_set() or job.staged is None:
        raise EngineError("the update is not staged", token=token)
    w.jobs.pop(token, None)
    return {"digests": w.commit_staged(job.staged), "root": w.root()}


def _audit(w: RuntimeWeights, budget: str) -> dict[str, Any]:
    r = w.audit(int(budget))
    return {"tensors": r.tensors, "bytes": r.nbytes, "mismatched": list(r.mismatched),
            "wrapped": r.wrapped, "tainted": w.tainted}


def _apply_encoded(w: RuntimeWeights, path: str) -> dict[str, Any]:
    header = inspect(Path(path).read_bytes())
    patch = _chain(w, [{"base": header.base, "target": header.target, "paths": [path]}])
    return {"digests": w.commit(patch), "root": w.root()}


def _export(w: RuntimeWeights, name: str, path: str) -> dict[str, Any]:
    t = w[name]
    if w.rank == 0:
        save_view(View({name: t}), path)
    return {"bytes": t.nbytes}


_OPS: dict[str, Callable[[RuntimeWeights, str, str], dict[str, Any]]] = {
    "apply_encoded": lambda w, path, _: _apply_encoded(w, path),
    "stage": lambda w, path, _: _stage(w, path),
    "staged": lambda w, token, _: _staged(w, token),
    "commit": lambda w, token, _: _commit(w, token),
    "discard": lambda w, token, _: {"discarded": w.jobs.pop(token, None) is not None},
    "audit": lambda w, budget, _: _audit(w, budget),
    "apply": lambda w, path, _: {"digests": w.commit(read_decoded(path)), "root": w.root()},
    "load": lambda w, path, _: {"root": w.load(load_view(path, mmap=True))},
    "digest": lambda w, fresh, _: {"digests": w.digests(fresh=fresh == "1"), "root": w.root(),
                                   "tainted": w.tainted},
    "export": lambda w, name, path: _export(w, name, path),
    "info": lambda w, _a, _b: {"rank": w.rank, "tp": w.tp, "aliases": w.access.aliases,
                               "tensors": {n: [w.kind_of(n).name, list(w.placement(n).shape)]
                                           for n in w.names()}},
}


def run_op(model: Any, op: str, arg: str = "", arg2: str = "") -> dict[str, Any]:
    """Run one extension operation; never raises (errors become ``{"ok": False, ...}``)."""
    fn = _OPS.get(op)
    if fn is None:
        return run_op_on(None, lambda _: _unknown(op))
    return run_op_on(None, lambda _: fn(weights_of(model), arg, arg2))


def _unknown(op: str) -> dict[str, Any]:
    raise EngineError(f"unknown rollpatch operation {op!r}", known=",".join(sorted(_OPS)))


def run_op_on(w: Any, fn: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """``fn(w)`` as a JSON-able result: ``ok`` plus its dict, or ``error``; with ``ms``."""
    t0 = time.perf_counter()
    try:
        out = {"ok": True, **fn(w)}
    except RollpatchError as err:
        out = {"ok": False, "error": {"type": type(err).__name__, "message": err.message,
                                      "hint": err.hint, "context": _jsonable(err.context)}}
    except Exception as err:  # noqa: BLE001 - reported to the adapter, which raises EngineError
        out = {"ok": False, "error": {"type": "InternalError",
                                      "message": f"{type(err).__name__}: {err}"}}
    out["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    return out


def _jsonable(ctx: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (str, int, float, bool)) or v is None else str(v)
            for k, v in ctx.items()}


class WorkerExtension:
    """Methods mixed into every vLLM worker; call them with ``POST /collective_rpc``.

    All arguments are strings (only strings cross ``/collective_rpc``); all results are dicts
    (see :func:`run_op`). ``self`` is vLLM's worker.
    """

    def rollpatch_info(self) -> dict[str, Any]:
        """Rank, TP size, every checkpoint tensor's kind and shape, the transfer backend."""
        model = self.get_model()  # type: ignore[attr-defined]
        out = run_op(model, "info")
        engine = getattr(self, "weight_transfer_engine", None)
        official = type(engine).__name__ == "RollpatchTransferEngine"
        out["weight_transfer"] = BACKEND if official else None
        out["packed_modules"] = len([m for m in model.modules()
                                     if "_rollpatch_repack" in m.__dict__])
        return out

    def rollpatch_digest(self, fresh: str = "0") -> dict[str, Any]:
        """Every checkpoint tensor's digest and the root (``fresh="1"``: re-hash all)."""
        return run_op(self.get_model(), "digest", fresh)  # type: ignore[attr-defined]

    def rollpatch_apply_encoded(self, path: str) -> dict[str, Any]:
        """Decode the wire-format patch at ``path`` against the held words, commit it."""
        return run_op(self.get_model(), "apply_encoded", path)  # type: ignore[attr-defined]

    def rollpatch_stage(self, path: str) -> dict[str, Any]:
        """Start staging the steps named by the JSON spec at ``path`` (decode, compose, prove,
        lay out per runtime parameter) in a background thread; poll :meth:`rollpatch_staged`."""
        return run_op(self.get_model(), "stage", path)  # type: ignore[attr-defined]

    def rollpatch_staged(self, token: str) -> dict[str, Any]:
        """``state``: ``staging``, ``ready`` (with the proven target digests) or ``failed``."""
        return run_op(self.get_model(), "staged", token)  # type: ignore[attr-defined]

    def rollpatch_commit(self, token: str) -> dict[str, Any]:
        """Write the staged update ``token`` (under the caller's pause): writes and read-back."""
        return run_op(self.get_model(), "commit", token)  # type: ignore[attr-defined]

    def rollpatch_discard(self, token: str) -> dict[str, Any]:
        """Forget a staged update."""
        return run_op(self.get_model(), "discard", token)  # type: ignore[attr-defined]

    def rollpatch_audit(self, budget: str) -> dict[str, Any]:
        """Re-hash up to ``budget`` bytes of live weights against the held digests."""
        return run_op(self.get_model(), "audit", budget)  # type: ignore[attr-defined]

    def rollpatch_apply(self, path: str) -> dict[str, Any]:
        """Commit the decoded patch at ``path`` (:mod:`.transfer` format)."""
        return run_op(self.get_model(), "apply", path)  # type: ignore[attr-defined]

    def rollpatch_load(self, path: str) -> dict[str, Any]:
        """Overwrite every tensor with the keyframe (safetensors view) at ``path``."""
        return run_op(self.get_model(), "load", path)  # type: ignore[attr-defined]

    def rollpatch_export(self, name: str, path: str) -> dict[str, Any]:
        """Write one checkpoint tensor's words to ``path`` (safetensors; rank 0 writes)."""
        return run_op(self.get_model(), "export", name, path)  # type: ignore[attr-defined]

    def rollpatch_result(self, token: str) -> dict[str, Any]:
        """The result of the weight-transfer update tagged ``token`` (popped)."""
        results = getattr(self.get_model(), "_rollpatch_results", {})  # type: ignore[attr-defined]
        return results.pop(token, {"ok": False, "error": {
            "type": "EngineError", "message": "no weight-transfer result with this token"}})
