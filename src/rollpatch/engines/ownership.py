"""Which adapter drives one engine process's rollpatch state: one sidecar per engine.

Two sidecars on one engine would each load and commit their own run's words into state that
holds one set of weights and digests. On SGLang the first sidecar's audit then checked the
live words against the second's digests, passed, and went on labelling answers with its own
version (found by an audit, session 38); on vLLM the first one's audit found the change of
identity, but only at its next audit, a second or so of answers later. So every call carries
its adapter's ``owner`` token (SGLang's loader, :mod:`.sglang.loader`; vLLM's worker
extension, :mod:`.vllm.worker`):

- the state's first ``claim`` makes that adapter the owner;
- another adapter's claim is refused while the owner called within :data:`LEASE_S` seconds
  (its audit calls every second by default); after that, or once the owner closed
  (:meth:`Ownership.disown`), the other takes over, and the engine's identity changes, so
  that an audit of the adapter before (were it still alive) finds its verified words gone;
- every other operation of an adapter that is not the owner is refused (``taken_over`` in
  the error's context): that adapter's version is void until it sets one again. Both
  refusals carry ``other_adapter`` (what the adapters look for).

An owner whose process is gone lets go at once (:mod:`rollpatch.liveness`). The token
(:func:`owner_token`) says where its adapter runs: the kernel's boot id, its PID namespace, its pid and the process's start time.
An engine on the same kernel and in the same PID namespace reads ``/proc``; when that process
no longer exists (or is a zombie, or the pid is another process's), the owner was killed with
no chance to let go (``kill -9``), and the next adapter takes over without waiting the lease
(a sidecar restarted after ``kill -9`` served about 8 s after its start, the lease included).
Anywhere else (another container's PID namespace, another host), nothing can be told from a
pid, and the lease holds.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import EngineError
from ..liveness import process_token, token_gone

__all__ = ["LEASE_S", "Ownership", "owner_token"]

#: Seconds an adapter keeps the engine after its last call: several of its audit calls
#: (every second by default), and what a sidecar restarted after ``kill -9`` waits out.
LEASE_S = 5.0
_clock = time.monotonic  # the lease's clock (tests set their own here)


def owner_token() -> str:
    """A new adapter's token (:func:`rollpatch.liveness.process_token`)."""
    return process_token()


class Ownership:
    """The owner's token and when it last called (under the engine state's lock);
    ``engine``: the engine's name in messages."""

    def __init__(self, engine: str = "SGLang") -> None:
        self.engine = engine
        self.owner: str | None = None
        self.seen = 0.0

    def claim(self, owner: Any) -> bool:
        """``owner``'s start: True when it takes over from another adapter (whose verified
        state is then void); refused while the other is still calling."""
        other = self.claimable(owner)
        self.owner, self.seen = str(owner), _clock()
        return other

    def claimable(self, owner: Any) -> bool:
        """:meth:`claim`'s check alone (nothing changes): True when ``owner`` would take over
        from another adapter; refused (the same error) while the other is still calling."""
        now = _clock()
        other = self.owner not in (None, str(owner))
        if other and now - self.seen < LEASE_S and not token_gone(str(self.owner)):
            raise EngineError(
                f"this {self.engine} is driven by another rollpatch adapter (a second sidecar "
                "on one engine?)",
                other_adapter=True,
                other_called_s_ago=round(now - self.seen, 1),
                hint=f"one sidecar per engine: stop the other (it lets go {LEASE_S:g} s after "
                "its last call)",
            )
        return other

    def check(self, owner: Any) -> None:
        """An operation of ``owner`` (any other adapter's is refused)."""
        if owner != self.owner:
            raise EngineError(
                f"another rollpatch adapter took this {self.engine} over (two sidecars on one "
                "engine?)",
                other_adapter=True,
                taken_over=True,
                hint="one sidecar per engine: this one's version is void until it re-syncs",
            )
        self.seen = _clock()

    def disown(self) -> dict[str, Any]:
        """The owner closes: the next adapter may start at once."""
        self.owner = None
        return {"disowned": True}
