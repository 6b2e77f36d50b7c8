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
from typing import Any

import numpy as np

from ...errors import EngineError
from .experts_cpu import check_packed, keep_plain_experts
from .ops import OPS, run_op_on
from .params import TorchParams
from .weights import RuntimeWeights

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
        layer._rollpatch_repack = original  # rebuilt after writes to layer.weight, if it owns
        layer._rollpatch_owns, layer._rollpatch_kernel_only = _probe(layer)

    dispatch._rollpatch = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch


def _probe(layer: Any) -> tuple[bool, bool]:
    """(owns, kernel_only) for a layer the CPU dispatcher just set up. ``owns``: its kernel
    holds its own copy of the words, so writes to the plain weight need a rebuild — found by
    negating the plain weight in place (negated back at once: exact) and calling the kernel on
    a random input: an unchanged output means the kernel did not read the live words (True
    too when the probe cannot tell: rebuilding is always safe). ``kernel_only``: it owns,
    the probe was conclusive, and nothing else reads the plain weight (a linear layer or an LM
    head; not an embedding, whose lookup reads it): its plain words may then be written after
    a commit's pause (:mod:`.writes`)."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    linear, w = getattr(layer, "cpu_linear", None), getattr(layer, "weight", None)
    if linear is None or w is None or w.dim() != 2 or w.is_meta or w.numel() == 0:
        return True, False
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, int(w.shape[1]), generator=gen).to(w.dtype)
        bias = getattr(layer, "bias", None)
        before = linear(x, w, bias)
        w.neg_()
        try:
            after = linear(x, w, bias)
        finally:
            w.neg_()
    owns = torch.equal(before, after)
    conclusive = bool(before.abs().sum() > 0)
    return owns, owns and conclusive and isinstance(layer, (LinearBase, ParallelLMHead))


def _register_backend() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rollpatch.engines.vllm.backend", "RollpatchTransferEngine"
        )


if "vllm" in sys.modules:  # inside vLLM: install before the model loads
    _keep_plain_weights()
    keep_plain_experts()  # the CPU MoE kernel's packed experts (.experts_cpu)
    _register_backend()


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
        state = RuntimeWeights(specs, kinds, TorchParams(model, tp).access(), rank=rank, tp=tp)
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
        out["owning_modules"] = len(
            [m for m in model.modules() if m.__dict__.get("_rollpatch_owns")]
        )
        out["kernel_only_modules"] = len(
            [m for m in model.modules() if m.__dict__.get("_rollpatch_kernel_only")]
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

    def rollpatch_settled(self) -> dict[str, Any]:
        """Wait until the words written after the last commit's pause are in place (blocks
        this worker: for tests and benches); the batch's size, time and failure."""
        return run_op(self.get_model(), "settled")  # type: ignore[attr-defined]

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

    def rollpatch_packed(self) -> dict[str, Any]:
        """Re-pack every CPU-packed expert layer's plain words with vLLM's own prepack (whole
        and per expert) and compare with the live packed parameters (tests and drills), once
        the plain words written after the last pause are in place."""

        def check(model: Any) -> dict[str, Any]:
            weights_of(model).settler.wait()
            return check_packed(model)

        return run_op_on(self.get_model(), check)  # type: ignore[attr-defined]

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
