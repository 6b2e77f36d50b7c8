"""vLLM side: the worker extension that holds a served view inside stock vLLM.

Start vLLM with ``--worker-extension-cls rollpatch.engines.vllm.WorkerExtension`` (and,
for the official weight-update routes, ``--weight-transfer-config '{"backend": "rollpatch"}'``).
Importing this module inside a vLLM process does two things, before the model loads:

- on the CPU platform, wraps ``dispatch_cpu_unquantized_gemm`` so it always keeps the plain
  weight (``remove_weight=False``) and remembers how to rebuild the packed one: the CPU backend
  otherwise copies each linear weight into an opaque oneDNN buffer and empties
  ``layer.weight``, leaving nothing to read digests from or patch in place;
- registers the ``rollpatch`` weight-transfer backend (lazily, by module path);
- with ``ROLLPATCH_VLLM_POLL_MS`` set, makes the worker's shm message-queue reader poll
  instead of spinning (:mod:`.spin`).

It imports neither torch nor vLLM itself: where vLLM is not already imported (a sidecar, a
type checker) it does nothing. Every method returns a JSON-able dict (``ok`` plus results, or
``error`` with the rollpatch exception class, message and context) because only those cross
``/collective_rpc`` intact.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from ...errors import EngineError
from .experts_cpu import (
    PackedAudit,
    audit_packed,
    check_packed,
    flip_packed,
    is_packed_experts,
    keep_plain_experts,
)
from .ops import OPS, check_owner, require_fault_injection, run_op_on
from .params import TorchParams
from .spin import install as _poll_instead_of_spin
from .weights import RuntimeWeights

__all__ = ["BACKEND", "WorkerExtension", "run_op"]

#: The weight-transfer backend name (``--weight-transfer-config '{"backend": "rollpatch"}'``).
BACKEND = "rollpatch"
_STATE = "_rollpatch_weights"
_PACKED_AUDIT = "_rollpatch_packed_audit"
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
    _poll_instead_of_spin()


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


def run_op(model: Any, op: str, arg: str = "", arg2: str = "", owner: str = "") -> dict[str, Any]:
    """Run one extension operation for the adapter ``owner`` (:func:`.ops.check_owner`; a
    ``claim`` names it in ``arg``); never raises (errors become ``{"ok": False, ...}``)."""
    fn = OPS.get(op)
    if fn is None:
        return run_op_on(None, lambda _: _unknown(op))

    def call(_: Any) -> dict[str, Any]:
        w = weights_of(model)
        if op != "claim":
            check_owner(w, owner)
        return {**fn(w, arg, arg2), "boot": w.identity}

    return run_op_on(None, call)


def audit(model: Any, budget: int, owner: str = "") -> dict[str, Any]:
    """One audit pass within ``budget`` bytes: the view's live words re-hashed (the ``audit``
    op) and, on the CPU at TP = 1, a rotating slice of vLLM's packed experts re-packed from
    their plain words and compared (:func:`.experts_cpu.audit_packed`; its share of the budget
    in proportion to its cost). Either mismatch marks the engine tainted. Neither runs while
    words are still being written after a pause."""
    w = weights_of(model)
    check_owner(w, owner)
    state = model.__dict__.get(_PACKED_AUDIT)
    if state is None:
        state = PackedAudit.of(model) if w.tp == 1 else PackedAudit([])
        state.view_bytes = sum(
            w.placement(n).n_elements * w.kind_of(n).elem_dtype.itemsize for n in w.names()
        )
        object.__setattr__(model, _PACKED_AUDIT, state)
    share = 0 if w.settler.busy or budget <= 0 else state.share(budget)
    t0 = time.perf_counter()
    plain = max(budget - share, 1) if budget > 0 else 0  # 0: a heartbeat, nothing hashed
    out = OPS["audit"](w, str(plain), "")
    out["hash_ms"] = (time.perf_counter() - t0) * 1e3
    out["boot"] = w.identity
    if share:
        r = audit_packed(state, share)
        if r.mismatched and w.tainted is None:
            w.tainted = r.mismatched[0]
        out["mismatched"] = [*out["mismatched"], *r.mismatched]
        out["tainted"] = w.tainted
        out["packed"] = {
            "experts": r.experts,
            "bytes": r.nbytes,
            "charged": r.charged,
            "mismatched": list(r.mismatched),
            "wrapped": r.wrapped,
            "ms": r.ms,
        }
    return out


def _unknown(op: str) -> dict[str, Any]:
    raise EngineError(f"unknown rollpatch operation {op!r}", known=",".join(sorted(OPS)))


class WorkerExtension:
    """Methods mixed into every vLLM worker; call them with ``POST /collective_rpc``.

    All arguments are strings (only strings cross ``/collective_rpc``); all results are dicts
    (see :func:`run_op`). ``self`` is vLLM's worker.
    """

    def rollpatch_claim(self, owner: str) -> dict[str, Any]:
        """Make the adapter ``owner`` this engine's (refused while another one calls: one
        sidecar per engine, :mod:`rollpatch.engines.ownership`). Every later call of the
        adapter carries its token (``owner=``); another adapter's is refused."""
        return run_op(self.get_model(), "claim", owner)  # type: ignore[attr-defined]

    def rollpatch_disown(self, owner: str = "") -> dict[str, Any]:
        """The owner closes: another adapter may claim this engine at once."""
        return run_op(self.get_model(), "disown", owner=owner)  # type: ignore[attr-defined]

    def rollpatch_info(self, owner: str = "") -> dict[str, Any]:
        """Rank, TP size, every checkpoint tensor's kind and shape, the transfer backend."""
        model = self.get_model()  # type: ignore[attr-defined]
        out = run_op(model, "info", owner=owner)
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

    def rollpatch_digest(self, fresh: str = "0", owner: str = "") -> dict[str, Any]:
        """Every checkpoint tensor's digest and the root (``fresh="1"``: re-hash all)."""
        return run_op(self.get_model(), "digest", fresh, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_apply_encoded(self, path: str, owner: str = "") -> dict[str, Any]:
        """Decode the wire-format patch at ``path`` against the held words, commit it."""
        return run_op(self.get_model(), "apply_encoded", path, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_stage(self, path: str, owner: str = "") -> dict[str, Any]:
        """Start staging the steps named by the JSON spec at ``path`` (decode, compose, prove,
        lay out per runtime parameter) in a background thread; poll :meth:`rollpatch_staged`."""
        return run_op(self.get_model(), "stage", path, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_staged(self, token: str, owner: str = "") -> dict[str, Any]:
        """``state``: ``staging``, ``ready`` (with the proven target digests) or ``failed``."""
        return run_op(self.get_model(), "staged", token, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_commit(self, token: str, owner: str = "") -> dict[str, Any]:
        """Write the staged update ``token`` (under the caller's pause): writes and read-back."""
        return run_op(self.get_model(), "commit", token, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_undo(self, token: str, owner: str = "") -> dict[str, Any]:
        """TP > 1: write back the old words of the commit of ``token`` if it was this rank's
        last (another rank's commit failed); ``undone``: whether there was one to undo."""
        return run_op(self.get_model(), "undo", token, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_settled(self, owner: str = "") -> dict[str, Any]:
        """Wait until the words written after the last commit's pause are in place (blocks
        this worker: for tests and benches); the batch's size, time and failure."""
        return run_op(self.get_model(), "settled", owner=owner)  # type: ignore[attr-defined]

    def rollpatch_discard(self, token: str, owner: str = "") -> dict[str, Any]:
        """Forget a staged update."""
        return run_op(self.get_model(), "discard", token, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_audit(self, budget: str, owner: str = "") -> dict[str, Any]:
        """Re-hash up to ``budget`` bytes of live weights against the held digests, and
        re-pack and compare a slice of the CPU-packed experts (:func:`audit`)."""
        return run_op_on(self.get_model(), lambda m: audit(m, int(budget), owner))  # type: ignore[attr-defined]

    def rollpatch_forget(self, owner: str = "") -> dict[str, Any]:
        """Fault injection for drills and tests: drop this worker's rollpatch state, as an
        engine restarted under its sidecar has none (a new ``boot`` identity at the next
        call; the words stay). Refused unless ``ROLLPATCH_FAULT_INJECTION=1``."""

        def forget(model: Any) -> dict[str, Any]:
            require_fault_injection()
            check_owner(weights_of(model), owner)
            state = model.__dict__.get(_STATE)
            if state is not None:
                state.settler.wait()
                del model.__dict__[_STATE]
            return {"forgot": state is not None}

        return run_op_on(self.get_model(), forget)  # type: ignore[attr-defined]

    def rollpatch_flip(
        self, name: str, position: str, target: str = "plain", owner: str = ""
    ) -> dict[str, Any]:
        """Fault injection for drills and tests: flip the lowest bit of one element of a
        checkpoint tensor in place, behind every digest (``target="packed"``: of the word at
        flat ``position`` of a CPU-packed expert parameter ``name``, behind its plain words).
        Refused unless the server was started with ``ROLLPATCH_FAULT_INJECTION=1``."""
        if target == "plain":
            return run_op(self.get_model(), "flip", name, position, owner=owner)  # type: ignore[attr-defined]

        def packed(model: Any) -> dict[str, Any]:
            require_fault_injection()
            if target != "packed":
                raise EngineError("unknown flip target", target=target, known="plain,packed")
            check_owner(weights_of(model), owner)
            weights_of(model).settler.wait()
            return {"flipped": flip_packed(model, name, int(position))}

        return run_op_on(self.get_model(), packed)  # type: ignore[attr-defined]

    def rollpatch_apply(self, path: str, owner: str = "") -> dict[str, Any]:
        """Commit the decoded patch at ``path`` (:mod:`.transfer` format)."""
        return run_op(self.get_model(), "apply", path, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_load(self, path: str, owner: str = "") -> dict[str, Any]:
        """Overwrite every tensor with the keyframe (safetensors view) at ``path``."""
        return run_op(self.get_model(), "load", path, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_export(self, name: str, path: str, owner: str = "") -> dict[str, Any]:
        """Write one checkpoint tensor's words to ``path`` (safetensors; rank 0 writes)."""
        return run_op(self.get_model(), "export", name, path, owner=owner)  # type: ignore[attr-defined]

    def rollpatch_packed(self, none_ok: str = "0", owner: str = "") -> dict[str, Any]:
        """Re-pack every CPU-packed expert layer's plain words with vLLM's own prepack (whole
        and per expert) and compare with the live packed parameters (an adoption, tests and
        drills), once the plain words written after the last pause are in place. A model with
        no such layer is an error, unless ``none_ok="1"`` (then nothing mismatched)."""

        def check(model: Any) -> dict[str, Any]:
            check_owner(weights_of(model), owner)
            weights_of(model).settler.wait()
            if none_ok == "1" and not any(is_packed_experts(m) for m in model.modules()):
                return {"layers": 0, "experts": 0, "mismatched": [], "relaid": 0}
            return check_packed(model)

        return run_op_on(self.get_model(), check)  # type: ignore[attr-defined]

    def rollpatch_result(self, token: str, owner: str = "") -> dict[str, Any]:
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
