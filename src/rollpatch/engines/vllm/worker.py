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

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BaseMismatchError, EngineError, RollpatchError
from ...io.safetensors import load_view, save_view
from ...patch import decode, inspect
from ...view import View
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

    def write(name: str, offsets: np.ndarray, values: np.ndarray) -> None:
        p = params[name]
        signed = values.view(_WORDS[p.element_size()][0])
        if cpu:
            a = views[name]
            elem = [s // a.itemsize for s in a.strides]
            span = 1 + sum((n - 1) * s for n, s in zip(a.shape, elem))
            flat = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,))
            flat[storage_offsets(offsets, a.shape, elem)] = values
            return
        w = words(p).view(shape2(p))  # a view (never a copy); indexing it is stride-aware
        r, c = np.divmod(offsets, w.shape[1])
        idx = (torch.from_numpy(r).to(p.device), torch.from_numpy(c).to(p.device))
        w.index_put_(idx, torch.from_numpy(np.ascontiguousarray(signed)).to(p.device))

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

    return Access(read, write, write_block, repack, gather if tp > 1 else None, aliases=cpu)


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


def _apply_encoded(w: RuntimeWeights, path: str) -> dict[str, Any]:
    blob = Path(path).read_bytes()
    header = inspect(blob)  # the container and header, validated; no payload touched yet
    if w.root() != header.base:  # decoding against another base would read wrong contexts
        raise BaseMismatchError("engine root digest is not the patch's base",
                                expected=header.base[:16], actual=w.root()[:16],
                                hint="the engine is on another version; plan a new path")
    names = sorted(e["name"] for e in header.tensors)
    source = View({n: w[n] for n in names if n in w})  # read in order: a collective at TP > 1
    return {"digests": w.commit(decode(blob, source, check_base=False)), "root": w.root()}


def _export(w: RuntimeWeights, name: str, path: str) -> dict[str, Any]:
    t = w[name]
    if w.rank == 0:
        save_view(View({name: t}), path)
    return {"bytes": t.nbytes}


_OPS: dict[str, Callable[[RuntimeWeights, str, str], dict[str, Any]]] = {
    "apply_encoded": lambda w, path, _: _apply_encoded(w, path),
    "apply": lambda w, path, _: {"digests": w.commit(read_decoded(path)), "root": w.root()},
    "load": lambda w, path, _: {"root": w.load(load_view(path, mmap=True))},
    "digest": lambda w, fresh, _: {"digests": w.digests(fresh=fresh == "1"), "root": w.root()},
    "export": lambda w, name, path: _export(w, name, path),
    "info": lambda w, _a, _b: {"rank": w.rank, "tp": w.tp, "aliases": w.access.aliases,
                               "tensors": {n: [w.kind_of(n).name, list(w.placement(n).shape)]
                                           for n in w.names()}},
}


def run_op(model: Any, op: str, arg: str = "", arg2: str = "") -> dict[str, Any]:
    """Run one extension operation; never raises (errors become ``{"ok": False, ...}``)."""
    t0 = time.perf_counter()
    try:
        fn = _OPS.get(op)
        if fn is None:
            raise EngineError(f"unknown rollpatch operation {op!r}", known=",".join(sorted(_OPS)))
        out = {"ok": True, **fn(weights_of(model), arg, arg2)}
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
