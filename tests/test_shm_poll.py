"""rollpatch.engines.vllm.spin without vLLM (so it runs in the plain test job): a
SpinCondition-shaped class with a poller over a socket pair (the live vLLM servers run with
the patch on: tests/vllm_env.server_env)."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Any

import pytest

from rollpatch.engines.vllm import spin


class Poller:
    """zmq.Poller's ``poll(timeout=ms)`` over plain sockets; counts its calls."""

    def __init__(self, *socks: Any) -> None:
        self.socks = socks
        self.calls: list[int | None] = []

    def poll(self, timeout: int | None = None) -> list[tuple[Any, int]]:
        self.calls.append(timeout)
        wait = None if timeout is None else timeout / 1e3
        ready, _, _ = select.select([s.sock for s in self.socks], [], [], wait)
        return [(s, 1) for s in self.socks if s.sock in ready]


class Sub:
    """The reader's notify socket: ``recv(flags, copy)`` takes one notify."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.flags: list[int] = []

    def recv(self, flags: int = 0, copy: bool = True) -> bytes:
        self.flags.append(flags)
        return self.sock.recv(1)


class Cond:
    """vLLM 0.32.0's SpinCondition, reader side, in shape: the names its ``__init__`` sets and
    ``wait(self, timeout_ms=None)``; the original wait only records that it ran."""

    def __init__(self, busy_loop_s: float = 1.0) -> None:
        self.is_reader = True
        self.last_read = time.monotonic()
        self.busy_loop_s = busy_loop_s
        self._w, r = socket.socketpair()
        self.local_notify_socket = Sub(r)
        self.poller = Poller(self.local_notify_socket)
        self.original: list[int | None] = []

    def wait(self, timeout_ms: int | None = None) -> None:
        self.original.append(timeout_ms)

    def record_read(self) -> None:
        self.last_read = time.monotonic()

    def notify(self) -> None:
        self._w.send(b"\x00")


def fresh() -> type[Cond]:
    """A new subclass per test: install patches the class it is given, once."""
    return type("Cond", (Cond,), {"wait": Cond.wait})


ON = {spin.ENV: "2"}


@pytest.mark.parametrize("raw", ["0", "-1", "x", "1.5", "1e3"])
def test_poll_ms_refuses_bad_values(raw: str) -> None:
    with pytest.raises(ValueError, match=spin.ENV):
        spin.poll_ms({spin.ENV: raw})


def test_poll_ms_unset_or_empty_is_vllms_default() -> None:
    assert spin.poll_ms({}) is None
    assert spin.poll_ms({spin.ENV: ""}) is None
    assert spin.poll_ms({spin.ENV: " 7 "}) == 7
    cls = fresh()
    before = cls.__dict__["wait"]
    assert spin.install(cls, {}) is False
    assert cls.__dict__["wait"] is before


def test_inside_the_window_it_polls_and_consumes_the_notify() -> None:
    cls = fresh()
    assert spin.install(cls, ON) is True
    assert spin.install(cls, ON) is True  # once: the second install keeps the first
    cond = cls()
    cond.wait(timeout_ms=5000)  # just after a read: vLLM's spin (the next step comes soon)
    assert cond.original == [5000] and cond.poller.calls == []
    cond.last_read -= 2 * spin.SPIN_S
    cond.wait(timeout_ms=5000)  # no notify: waits the poll bound, not the caller's 5 s
    assert cond.poller.calls == [2] and cond.original == [5000]
    cond.notify()
    t0 = time.monotonic()
    cond.wait(timeout_ms=5000)
    assert time.monotonic() - t0 < 1.0
    assert cond.local_notify_socket.flags == [1]  # consumed, non-blocking
    cond.wait(timeout_ms=1)  # the caller's smaller timeout wins
    assert cond.poller.calls[-1] == 1
    cond.last_read -= 2.0  # past the busy window: vLLM's own wait
    cond.wait(timeout_ms=5000)
    assert cond.original == [5000, 5000]


def test_a_reader_wakes_on_notify_and_without_one() -> None:
    """As MessageQueue.acquire_read: check the flag, wait, check again. A notify wakes the
    reader at once; a notify that never comes (dropped by the PUB high-water mark) costs at
    most a few poll bounds, not the caller's 5 s recheck."""
    cls = fresh()
    spin.install(cls, ON)
    for notify in (True, False):
        cond = cls()
        cond.last_read -= 2 * spin.SPIN_S  # past the short spin, inside the busy window
        written = threading.Event()

        def write(
            cond: Cond = cond, notify: bool = notify, written: threading.Event = written
        ) -> None:
            time.sleep(0.05)
            written.set()
            if notify:
                cond.notify()

        writer = threading.Thread(target=write)
        writer.start()
        cpu0 = time.thread_time()
        while not written.is_set():
            cond.wait(timeout_ms=5000)
        late = time.monotonic()
        writer.join()
        # the wait polled (bounded, 2 ms each) rather than spun: far less than the 50 ms wall
        assert time.thread_time() - cpu0 < 0.04
        assert all(c == 2 for c in cond.poller.calls)
        assert late - cond.last_read < 1.0


class NoPoller:
    def __init__(self) -> None:
        self.is_reader = True
        self.last_read = 0.0
        self.busy_loop_s = 1.0

    def wait(self, timeout_ms: int | None = None) -> None:
        pass


class OtherWait(Cond):
    def wait(self, timeout: float | None = None) -> None:  # type: ignore[override]
        pass


@pytest.mark.parametrize(
    ("cls", "why"),
    [(NoPoller, "sets no poller, local_notify_socket"), (OtherWait, "expected")],
)
def test_another_shape_keeps_vllms_wait(
    cls: type, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    before = cls.__dict__["wait"]
    with caplog.at_level(logging.WARNING, logger=spin.__name__):
        assert spin.install(cls, ON) is False
    assert cls.__dict__["wait"] is before
    assert why in caplog.text and spin.ENV in caplog.text
