"""``rollpatch demo``: cross-region asynchronous RL on one machine (see docs/demo.md).

A trainer process runs GRPO on a tiny locally made model and publishes a version after every
step; three rollout islands (sidecar + reference engine, one process each) follow the board —
one directly, two through regional relays behind an *emulated* WAN link — and a gateway routes
the trainer's rollout requests among them under a staleness bound. The orchestrator
(:func:`run_demo`) shows the run live, checks its invariants and writes a report and plots.

The child-process entry points are ``python -m rollpatch.demo.trainer``, ``.island`` and
``.relays``; they are internal to the demo.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import DemoConfig

if TYPE_CHECKING:
    from .run import DemoFailed, run_demo

__all__ = ["DemoConfig", "DemoFailed", "run_demo"]


def __getattr__(name: str) -> Any:
    # the orchestrator (board, publisher, follower, live view) is imported when asked for:
    # every ``rollpatch`` command reads DemoConfig to build its parser, and only ``demo`` runs
    if name in ("DemoFailed", "run_demo"):
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
