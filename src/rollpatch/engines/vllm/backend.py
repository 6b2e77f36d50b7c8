"""The ``rollpatch`` weight-transfer backend: vLLM's official weight-update routes, in place.

Registered (by module path) when :mod:`.worker` is imported inside vLLM; enabled with
``--weight-transfer-config '{"backend": "rollpatch"}'``. Then::

    POST /start_weight_update
    POST /update_weights   {"update_info": {"op": "apply_encoded" | "apply" | "load",
                                            "path": "<file the adapter wrote>",
                                            "token": "<nonce>",
                                            "owner": "<the adapter's token>"}}
    POST /finish_weight_update {"weight_version": "<version>"}

``update_weights`` cannot return anything over HTTP, so each worker keeps its result dict
(the same as :func:`~rollpatch.engines.vllm.worker.run_op` returns) under the token, and the
adapter collects it with ``collective_rpc("rollpatch_result", token)`` before deciding whether
to finish with the new ``weight_version``. Start and finish do nothing else: patches are
applied in place and verified inside ``update_weights``. Imports vLLM (only ever loaded by
vLLM's factory, inside a worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .worker import run_op

__all__ = ["RollpatchInitInfo", "RollpatchTransferEngine", "RollpatchUpdateInfo"]

_KEEP_RESULTS = 16
_OPS = ("apply_encoded", "apply", "load", "commit")


@dataclass
class RollpatchInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the adapter and vLLM share a filesystem."""


@dataclass
class RollpatchUpdateInfo(WeightTransferUpdateInfo):
    """One update: which operation, the file it reads, the token its result is kept under,
    and the adapter's owner token (:mod:`rollpatch.engines.ownership`)."""

    op: str
    path: str
    token: str
    owner: str = ""


class RollpatchTransferEngine(WeightTransferEngine[RollpatchInitInfo, RollpatchUpdateInfo]):
    """Applies rollpatch patches and keyframes from files, in place, verified."""

    init_info_cls = RollpatchInitInfo
    update_info_cls = RollpatchUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RollpatchInitInfo) -> None:
        """No connection to set up."""

    def start_weight_update(self) -> None:
        """Nothing to prepare: updates are in place."""

    def finish_weight_update(self) -> None:
        """Nothing to finalise: each update was verified when applied."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse and apply synchronously (no accelerator sync needed: the commit verified)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RollpatchUpdateInfo) -> None:
        if update_info.op in _OPS:
            result = run_op(self.model, update_info.op, update_info.path, owner=update_info.owner)
        else:
            result = {
                "ok": False,
                "error": {"type": "EngineError", "message": f"unknown op {update_info.op!r}"},
            }
        results: dict[str, Any] = self.model.__dict__.setdefault("_rollpatch_results", {})
        while len(results) >= _KEEP_RESULTS:
            results.pop(next(iter(results)))
        results[update_info.token] = result

    def shutdown(self) -> None:
        """Nothing to release."""
