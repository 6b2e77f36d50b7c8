"""The adapter's side of a commit's KV mode (:data:`.core.KvOnCommit`): the mode asked for,
the one the engine-core hook reports it applied, and the one warning when they differ."""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ConfigError
from ...validate import check_choice
from .core import KV_ON_COMMIT, KvOnCommit

__all__ = ["KvMode"]

log = logging.getLogger("rollpatch.engines.vllm")


class KvMode:
    """``requested``: what staged commits ask the hook for; ``applied``: what the last one
    did (``None`` before any); ``running``: how many requests it applied it to."""

    def __init__(self, requested: KvOnCommit) -> None:
        check_choice("VllmEngine", "kv_on_commit", requested, KV_ON_COMMIT)
        self.requested: KvOnCommit = requested
        self.applied: str | None = None
        #: The requests running when the last staged commit wrote (the hook's count; -1
        #: where vLLM's scheduler does not say): those it kept or recomputed.
        self.running: int | None = None
        self._warned = False

    @property
    def current(self) -> str:
        """What a commit does to the KV of requests in flight (the last applied, else asked)."""
        return self.applied or self.requested

    def require_hook(self, engine: str) -> None:
        """Without the engine-core hook a commit can only recompute."""
        if self.requested == "keep":
            raise ConfigError(
                "kv_on_commit 'keep' needs vLLM's engine-core hook",
                engine=engine,
                hint="start vLLM with --scheduler-cls rollpatch.engines.vllm.core.Scheduler "
                "(rollpatch.engines.vllm.launch does)",
            )

    def note(self, result: dict[str, Any]) -> None:
        """Record the hook's report (``kv``); warn once when it did not keep as asked (a server
        with a KV connector, whose cache keep mode does not reach: :mod:`.core`)."""
        self.applied = str(result.get("kv", "recompute"))
        self.running = int(result.get("running", -1))
        if self.applied != self.requested and not self._warned:
            self._warned = True
            log.warning(
                "vLLM commit recomputed the KV of requests in flight instead of keeping it: the "
                "server runs a KV connector, whose cache keep mode does not reach (docs/vllm.md)"
            )
