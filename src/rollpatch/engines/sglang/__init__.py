"""Stock SGLang as a rollout engine, patched in place in its runtime coordinates.

Two halves, one package:

- **inside SGLang** (launched with ``--custom-weight-loader
  rollpatch.engines.sglang.loader.rollpatch_weight_loader``): :mod:`.loader` maps checkpoint
  names and positions onto SGLang's fused, sharded parameters (:mod:`.describe`), stages
  patches on a control thread while SGLang generates and scatters them between two forward
  passes (:mod:`.staged`);
- **the adapter** (:class:`SglangEngine`, in the sidecar's process) drives it over HTTP and a
  UNIX socket (:mod:`.channel`, wire formats in :mod:`.wire`).

Names are imported lazily: importing this package imports neither torch nor SGLang. See
docs/sglang.md.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import LOADER, SglangEngine
    from .staged import HeldWeights, Staged
    from .words import RemoteWords

__all__ = ["LOADER", "HeldWeights", "RemoteWords", "SglangEngine", "Staged"]

_WHERE = {
    "LOADER": "adapter",
    "RemoteWords": "words",
    "SglangEngine": "adapter",
    "HeldWeights": "staged",
    "Staged": "staged",
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
