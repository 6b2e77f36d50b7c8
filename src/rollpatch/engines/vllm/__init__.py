"""Stock vLLM as a rollout engine, patched in place in its runtime coordinates.

Two halves, one package:

- the **worker extension** (:class:`WorkerExtension`, loaded by vLLM with
  ``--worker-extension-cls rollpatch.engines.vllm.WorkerExtension``) maps checkpoint names and
  element positions onto vLLM's fused, sharded parameters (:mod:`.layout`, :mod:`.describe`),
  decodes and applies patches in place, verified (:mod:`.weights`), and serves the official
  weight-update routes through the ``rollpatch`` backend (:mod:`.backend`);
- the **adapter** (:class:`VllmEngine`, in the sidecar's process) drives it over HTTP.

Names are imported lazily: importing this package imports neither torch nor vLLM. See
docs/vllm.md.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import RemoteWords, VllmEngine
    from .transfer import read_decoded, write_decoded
    from .weights import Access, RuntimeWeights
    from .worker import WorkerExtension

__all__ = [
    "Access",
    "RemoteWords",
    "RuntimeWeights",
    "VllmEngine",
    "WorkerExtension",
    "read_decoded",
    "write_decoded",
]

_WHERE = {
    "Access": "weights",
    "RemoteWords": "adapter",
    "RuntimeWeights": "weights",
    "VllmEngine": "adapter",
    "WorkerExtension": "worker",
    "read_decoded": "transfer",
    "write_decoded": "transfer",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
