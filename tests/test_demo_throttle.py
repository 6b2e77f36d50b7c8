"""The demo's emulated store link (``rollpatch.store.ThrottledStore``, ``FairLink``): latency,
bandwidth shared fairly, failures, and bad settings refused. Pure and fast: a fake clock.
"""

from __future__ import annotations

import time

import pytest

from rollpatch.errors import ConfigError, NotFoundError
from rollpatch.store import MemoryStore, ThrottledStore
from rollpatch.store.throttle import FairLink


class FakeClock:
    """``clock``/``sleep`` pair: sleeping advances time (unless ``frozen``) and is recorded."""

    def __init__(self, frozen: bool = False) -> None:
        self.now = 0.0
        self.frozen = frozen
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        if not self.frozen:
            self.now += seconds


def _throttled(
    name: str, bps: float | None, latency: float, clock: FakeClock
) -> tuple[MemoryStore, ThrottledStore]:
    MemoryStore.reset(name)
    inner = MemoryStore(name)
    return inner, ThrottledStore(inner, bps, latency, clock=clock.clock, sleep=clock.sleep)


# -- ThrottledStore ------------------------------------------------------------------------------


def test_throttle_latency_only() -> None:
    clock = FakeClock()
    inner, link = _throttled("thr-lat", None, 0.25, clock)
    inner.put("a/b", b"x" * 1000)
    assert link.get("a/b") == b"x" * 1000
    assert clock.slept == [pytest.approx(0.25)]
    s = link.stats
    assert (s.calls, s.bytes_down, s.bytes_up) == (1, 1000, 0)
    assert s.delay_s == pytest.approx(0.25)


def test_throttle_bandwidth_adds_transfer_time() -> None:
    clock = FakeClock()
    inner, link = _throttled("thr-bw", 8e6, 0.05, clock)  # 8 Mbit/s = 1 MB/s
    inner.put("obj", bytes(1_000_000))
    link.get("obj")
    assert clock.now == pytest.approx(0.05 + 1.0)
    assert link.get_range("obj", 0, 500_000) == bytes(500_000)
    assert clock.now == pytest.approx(1.05 + 0.05 + 0.5)
    assert link.stats.bytes_down == 1_500_000


def test_fair_link_shares_bandwidth() -> None:
    link = FairLink(1e6)  # bytes per second
    link.add(1, 1e6, 0.0)
    link.add(2, 1e6, 0.0)
    assert link.eta(1) == pytest.approx(2.0)  # two equal transfers: each at half rate
    link.advance(2.0)
    assert link.done(1) and link.done(2)

    link.add(3, 1e6, 10.0)
    link.add(4, 1e6, 10.5)  # 3 has 0.5 MB left when 4 arrives
    assert link.eta(3) == pytest.approx(1.0)
    link.advance(11.5)
    assert link.done(3) and not link.done(4)
    assert link.eta(4) == pytest.approx(0.5)  # alone again: full rate

    link.add(5, 1e6, 20.0)
    link.add(6, 1_000, 20.1)  # a small read is not stuck behind a big one
    assert link.eta(6) == pytest.approx(0.002)
    link.advance(20.102)
    assert link.done(6) and not link.done(5)


def test_throttle_writes_lists_and_failures() -> None:
    clock = FakeClock()
    inner, link = _throttled("thr-misc", 8e6, 0.01, clock)
    link.put("k/1", bytes(100_000))  # 0.01 + 0.1 s
    assert inner.get("k/1") == bytes(100_000)
    assert link.list("k/") == ["k/1"]  # 4 bytes of keys: latency dominates
    with pytest.raises(NotFoundError):
        link.get("k/missing")  # a failure still pays its round trip
    assert link.head("k/1") is not None
    s = link.stats
    assert (s.calls, s.bytes_up, s.bytes_down) == (4, 100_000, 4)
    assert clock.now == pytest.approx(0.01 + 0.1 + (0.01 + 4 * 8 / 8e6) + 0.01 + 0.01)
    assert link.writable and link.uri == inner.uri


def test_throttle_real_clock_holds_at_least_the_latency() -> None:
    MemoryStore.reset("thr-real")
    inner = MemoryStore("thr-real")
    inner.put("x", b"1")
    link = ThrottledStore(inner, None, 0.02)
    t0 = time.monotonic()
    link.get("x")
    assert time.monotonic() - t0 >= 0.02  # a lower bound only: sleeps never end early


@pytest.mark.parametrize(
    "bps, latency", [(0, 0.1), (-1, 0.1), (1e6, -0.1), (float("nan"), 0.0), (True, 0.0)]
)
def test_throttle_rejects_bad_settings(bps: float, latency: float) -> None:
    with pytest.raises(ConfigError):
        ThrottledStore(MemoryStore("thr-bad"), bps, latency)
