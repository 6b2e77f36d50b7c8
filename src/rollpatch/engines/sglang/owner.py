"""Which adapter drives one SGLang process's rollpatch loader (:mod:`.loader`): one sidecar
per engine.

Two sidecars on one SGLang would each load and commit their own run's words, and the loader
holds one set of weights and digests: the first sidecar's audit would then check the live
words against the second's digests, pass, and go on labelling answers with its own version
(found by an audit, session 38). So every call carries its adapter's ``owner`` token:

- the loader's first ``start`` makes that adapter the owner;
- another adapter's ``start`` is refused while the owner called within :data:`LEASE_S`
  seconds (its audit calls every second by default); after that, or once the owner closed
  (``disown``), the other takes over, and the process's identity changes, so that an audit
  of the adapter before (were it still alive) finds its verified words gone;
- every other operation of an adapter that is not the owner is refused (``taken_over`` in
  the error's context): that adapter's version is void until it sets one again. Both
  refusals carry ``other_adapter`` (what the adapter's channel looks for).
"""

from __future__ import annotations

import time
from typing import Any

from ...errors import EngineError

__all__ = ["LEASE_S", "Ownership"]

#: Seconds an adapter keeps the loader after its last call.
LEASE_S = 15.0


class Ownership:
    """The owner's token and when it last called (under the loader's state lock)."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.seen = 0.0

    def claim(self, owner: Any) -> bool:
        """``owner``'s start: True when it takes over from another adapter (whose verified
        state is then void); refused while the other is still calling."""
        now = time.monotonic()
        other = self.owner not in (None, str(owner))
        if other and now - self.seen < LEASE_S:
            raise EngineError(
                "this SGLang is driven by another rollpatch adapter (a second sidecar on one "
                "engine?)",
                other_adapter=True,
                other_called_s_ago=round(now - self.seen, 1),
                hint=f"one sidecar per engine: stop the other (it lets go {LEASE_S:g} s after "
                "its last call)",
            )
        self.owner, self.seen = str(owner), now
        return other

    def check(self, req: dict[str, Any]) -> None:
        """An operation of the owner (any other adapter's is refused)."""
        if req.get("owner") != self.owner:
            raise EngineError(
                "another rollpatch adapter took this SGLang over (two sidecars on one engine?)",
                other_adapter=True,
                taken_over=True,
                hint="one sidecar per engine: this one's version is void until it re-syncs",
            )
        self.seen = time.monotonic()

    def disown(self) -> dict[str, Any]:
        """The owner closes: the next adapter may start at once."""
        self.owner = None
        return {"disowned": True}
