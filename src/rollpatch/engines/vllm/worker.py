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
import types
from typing import Any

import numpy as np

from ...errors import EngineError
from .layout import storage_offsets
from .ops import OPS, run_op_on
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
            BACKEND, "rollpatch.engines.vllm.backend", "RollpatchTransferEngine"
        )


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

    from ...native import core as native

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
        w.index_put_(
            device_index(p, prepared), torch.from_numpy(np.ascontiguousarray(signed)).to(p.device)
        )

    def read_at(name: str, prepared: np.ndarray) -> np.ndarray:
        p = params[name]
        if cpu:
            fl = flat(name)[0]
            if native is None or fl.itemsize not in (2, 4):
                return fl[prepared]
            out = np.empty(prepared.size, fl.dtype)
            native.gather((8 * fl.itemsize, 2, 0, 0), fl, prepared, out)  # GIL released
            return out
        got = words(p).view(shape2(p))[device_index(p, prepared)].cpu().numpy()
        return got.view(_WORDS[p.element_size()][1])

    def swap(name: str, prepared: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """CPU, native core: check old and write new in one pass (all or nothing)."""
        fl = flat(name)[0]
        if native is None or fl.itemsize not in (2, 4):
            scatter(name, prepared, new)
            return
        native.apply((8 * fl.itemsize, 2, 0, 0), fl, prepared, old, new)

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

    def prebuild(writes: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
        """Before the pause: each touched packed module's new ``cpu_linear``, built from a
        copy of its parameters with the staged words written in (one module at a time)."""
        out: dict[str, Any] = {}
        with torch.no_grad():
            for mod_name in sorted({p.rpartition(".")[0] for p in writes}):
                mod = model.get_submodule(mod_name) if mod_name else model
                rebuild = getattr(mod, "_rollpatch_repack", None)
                if rebuild is None:
                    continue
                shadow = types.SimpleNamespace()
                for attr in ("weight", "bias"):
                    p = getattr(mod, attr, None)
                    if p is None:
                        setattr(shadow, attr, None)
                        continue
                    copy = p.detach().clone()  # same strides: storage offsets carry over
                    key = f"{mod_name}.{attr}" if mod_name else attr
                    if key in writes:
                        prepared, new = writes[key]
                        a = words(copy).numpy().view(_WORDS[copy.element_size()][1])
                        flat = np.lib.stride_tricks.as_strided(
                            a,
                            shape=(int(prepared.max()) + 1 if prepared.size else 0,),
                            strides=(a.itemsize,),
                        )
                        flat[prepared] = new
                    setattr(shadow, attr, torch.nn.Parameter(copy, requires_grad=False))
                rebuild(shadow, remove_weight=False)
                if hasattr(shadow, "cpu_linear"):  # else: re-packed inside the pause
                    out[mod_name] = shadow.cpu_linear
        return out

    def install(prebuilt: dict[str, Any]) -> set[str]:
        """Under the pause: swap the prebuilt kernels in (O(1) per module); returns the
        modules installed."""
        for mod_name, linear in prebuilt.items():
            (model.get_submodule(mod_name) if mod_name else model).cpu_linear = linear
        return set(prebuilt)

    def gather(name: str, local: np.ndarray) -> list[np.ndarray]:
        from vllm.distributed import get_tp_group

        p = params[name]
        t = torch.from_numpy(np.ascontiguousarray(local).view(_WORDS[p.element_size()][0]))
        out = get_tp_group().all_gather(t.reshape(-1).to(p.device), dim=0)
        return [c.cpu().numpy().view(local.dtype).reshape(local.shape) for c in out.chunk(tp)]

    return Access(
        read,
        write,
        write_block,
        repack,
        gather if tp > 1 else None,
        aliases=cpu,
        prepare=prepare,
        scatter=scatter,
        read_at=read_at,
        prebuild=prebuild if cpu and tp == 1 else None,
        install=install,
        swap=swap if cpu else None,
    )


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


def run_op(model: Any, op: str, arg: str = "", arg2: str = "") -> dict[str, Any]:
    """Run one extension operation; never raises (errors become ``{"ok": False, ...}``)."""
    fn = OPS.get(op)
    if fn is None:
        return run_op_on(None, lambda _: _unknown(op))
    return run_op_on(None, lambda _: fn(weights_of(model), arg, arg2))


def _unknown(op: str) -> dict[str, Any]:
    raise EngineError(f"unknown rollpatch operation {op!r}", known=",".join(sorted(OPS)))


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
        out["packed_modules"] = len(
            [m for m in model.modules() if "_rollpatch_repack" in m.__dict__]
        )
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

    def rollpatch_flip(self, name: str, position: str) -> dict[str, Any]:
        """Fault injection for drills and tests: flip the lowest bit of one element of a
        checkpoint tensor in place, behind every digest. Refused unless the server was
        started with ``ROLLPATCH_FAULT_INJECTION=1``."""
        return run_op(self.get_model(), "flip", name, position)  # type: ignore[attr-defined]

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
        return results.pop(
            token,
            {
                "ok": False,
                "error": {
                    "type": "EngineError",
                    "message": "no weight-transfer result with this token",
                },
            },
        )
