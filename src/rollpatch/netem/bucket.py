"""The shared token bucket that caps a link's bandwidth, one per direction.

Pure arithmetic on a clock the caller passes in, so it is tested without sockets or sleeps.
"""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["TokenBucket"]


class TokenBucket:
    """Paces bytes at ``rate`` bytes/s with a burst allowance of ``burst`` bytes.

    :meth:`reserve` never blocks: it books link time for ``n`` bytes after everything booked
    before (so senders sharing the bucket share the rate, in booking order) and returns when
    the last of them has left. Booking ahead is allowed; the caller bounds how far ahead it
    books (the link's window). ``rate=None``: unlimited, everything leaves at once.
    """

    def __init__(self, rate: float | None, burst: int = 0) -> None:
        if rate is not None and not rate > 0:
            raise ConfigError("TokenBucket rate must be > 0 bytes/s or None", value=rate)
        if burst < 0:
            raise ConfigError("TokenBucket burst must be >= 0 bytes", value=burst)
        self.rate = rate
        self.burst = burst
        self._free_at = float("-inf")  # when the bytes booked so far have all left

    def reserve(self, n: int, now: float) -> float:
        """Book ``n`` bytes at time ``now``; returns when they have left (``>= now``)."""
        if self.rate is None:
            return now
        # An idle link has saved up at most `burst` bytes of credit: booking starts that far
        # back in virtual time, never earlier.
        start = max(self._free_at, now - self.burst / self.rate)
        self._free_at = start + n / self.rate
        return max(self._free_at, now)

    def backlog(self, now: float) -> float:
        """Seconds of booked traffic still ahead of ``now`` (0 when idle)."""
        return max(0.0, self._free_at - now)
