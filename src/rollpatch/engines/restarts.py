"""An engine restarted under its sidecar (vLLM, SGLang): it boots its checkpoint and holds no
rollpatch state, so the words it serves are not the version the sidecar labels. Its
rollpatch state (the vLLM workers', the SGLang loaders') carries a random identity, new in
every process; :class:`BootWatch` keeps the identity the held version was set under and
compares each audit's (docs/vllm.md, docs/sglang.md)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["RESTARTED", "BootWatch"]

log = logging.getLogger("rollpatch.engines")

#: The audit report's mismatch for a restart (it takes the island out of rotation).
RESTARTED = "(the engine restarted: its boot checkpoint's words)"


class BootWatch:
    """The engine state's identity the held version was set under (None: learnt from the
    next audit, when the call that set it did not say)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.held: Any = None

    def set(self, identity: Any, version: int | None) -> None:
        """The held version changed (``version`` None: none held)."""
        self.held = identity if version is not None else None

    def restarted(self, identity: Any, url: str, version: int | None) -> bool:
        """Whether an audit's ``identity`` says the engine restarted since the version was
        set (logged once, as a WARNING)."""
        if identity is None or version is None:
            return False
        if self.held is None:
            self.held = identity  # first seen since the version was set: the reference
            return False
        if identity == self.held:
            return False
        log.warning(
            "%s at %s restarted under the sidecar: it holds its boot checkpoint's words, not "
            "version %s; out of rotation until re-synced",
            self.engine,
            url,
            version,
        )
        return True
