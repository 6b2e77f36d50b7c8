"""The sidecar's stream relay in the engine connection's protocol (rollpatch.sidecar.relay,
issue 10), the protocol alone against the task's relay: the same events for any framing and
split, a bad chunk, the connection back to the pool after the last chunk (a live sidecar in
front of a scripted engine: tests/test_sidecar_tap_live.py).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from rollpatch.serving.streaming import SseRelay
from rollpatch.serving.upstream import UpstreamError
from rollpatch.sidecar import relay

_END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"  # the last event and the body's end


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.protocol: Any = None
        self.reading = True

    def write(self, b: bytes) -> None:
        self.out.append(b)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_protocol(self, p: Any) -> None:
        self.protocol = p

    def get_protocol(self) -> Any:
        return self.protocol


class _Flow:
    write_paused = False


class _Cycle:
    def __init__(self) -> None:
        self.disconnected = False
        self.flow = _Flow()
        self.transport = _Transport()


class _Conn:
    def __init__(self) -> None:
        self.transport = _Transport()
        self.buf = bytearray()
        self.eof = False
        self.paused = False


class _Resp:
    def __init__(self) -> None:
        self._conn = _Conn()


EVENTS = [
    b'data: {"a": 1}\n\n',
    b'data: {"t": "line\\nbreak"}\n\n',
    b'data:{"b":2}\n\n',
    b'data: {"d": "[DONE]"}\n\n',
    b": ping\n\n",
    b'event: x\ndata: {"c":3}\n\n',
    b"data: crlf\r\n\r\n",
    b"data: e\ndata: f\n\n",
]


def _last(line: bytes, done: bool) -> bytes:
    return b"LAST[" + line + (b"]done" if done else b"]open") + b"\n\n"


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked message (asserting it is well framed and complete)."""
    out: list[bytes] = []
    pos = 0
    while True:
        nl = raw.index(b"\r\n", pos)
        size = int(raw[pos:nl], 16)
        if size == 0:
            assert raw[nl:] == b"\r\n\r\n", raw[nl:]
            return b"".join(out)
        out.append(raw[nl + 2 : nl + 2 + size])
        assert raw[nl + 2 + size : nl + 4 + size] == b"\r\n"
        pos = nl + 4 + size


def _chunked(rng: random.Random, body: bytes) -> tuple[bytes, list[int]]:
    """``body`` in chunks as engines write them (one per event) or cut anywhere, with size
    lines in either case, zero-padded or with an extension now and then; then the end.
    Also: where each chunk ends."""
    parts: list[bytes] = []
    if rng.random() < 0.5:
        rest = body
        while rest:
            i = rest.find(b"\n\n")
            n = len(rest) if i < 0 else i + 2
            parts.append(rest[:n])
            rest = rest[n:]
    else:
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, 4))) if body else []
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    out, ends = b"", []
    for p in parts:
        size = rng.choice([b"%x" % len(p), b"%X" % len(p), b"00%x" % len(p), b"%x;ext=1" % len(p)])
        out += size + b"\r\n" + p + b"\r\n"
        ends.append(len(out))
    return out + rng.choice([b"0\r\n\r\n", b"0\r\nx-trailer: 1\r\n\r\n"]), ends


def _through_tap(reads: list[bytes]) -> tuple[bytes, relay.StreamTap, _Resp]:
    resp, cycle = _Resp(), _Cycle()
    done: list[bytes] = []
    tap = relay.StreamTap(resp, SseRelay(_last, on_done=lambda: done.append(b"")), cycle)  # type: ignore[arg-type]
    for r in reads:
        tap.data_received(r)
    tap._flush_held()  # as StreamTap.run does on its way out; then the task ends the relay
    end = tap._relay.finish()
    if end:
        cycle.transport.out.append(b"%x\r\n%b\r\n" % (len(end), end))
    body = b"".join(cycle.transport.out)
    return body, tap, resp


def test_the_tap_sends_the_events_of_the_task_relay_for_any_framing_and_split() -> None:
    rng = random.Random(10)
    for _ in range(3000):
        events = [rng.choice(EVENTS) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.7:
            events.append(b"data: [DONE]\n\n")
        body = b"".join(events)
        raw, ends = _chunked(rng, body)
        if rng.random() < 0.5:  # reads cut anywhere
            cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(0, 6))))
        else:  # reads of whole chunks (the common case: one or more events per read)
            cuts = [e for e in ends if rng.random() < 0.7]
        reads = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
        # the reference: the task's relay over the de-chunked body
        ref = SseRelay(_last, on_done=lambda: None)
        want = ref.feed(body) + ref.finish()
        got, tap, resp = _through_tap(reads)
        # what the client gets is chunked: its body is the reference's bytes exactly
        assert tap._ended
        client = got if not got else _dechunk(got + b"0\r\n\r\n")
        assert client == want, (reads, client, want)
        # the engine's last chunk and trailers go back to the pool's reader
        assert bytes(resp._conn.buf).startswith(b"0")


def test_events_keep_their_order_when_the_general_path_held_one() -> None:
    """A read of two chunks leaves the relay holding the second event; the single-chunk reads
    after it must not overtake it."""

    def chunk(e: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(e), e)

    ev = [b'data: {"a": %d}\n\n' % i for i in range(4)]
    reads = [chunk(ev[0]) + chunk(ev[1]), chunk(ev[2]), chunk(ev[3]), _END]
    got, _, _ = _through_tap(reads)
    assert _dechunk(got + b"0\r\n\r\n") == (
        ev[0] + ev[1] + ev[2] + b'LAST[data: {"a": 3}]done\n\ndata: [DONE]\n\n'
    )


def test_a_whole_plain_chunk_goes_out_as_it_came() -> None:
    ev = b'data: {"x": 1}\n\n'
    chunk = b"%x\r\n%b\r\n" % (len(ev), ev)
    assert relay._whole_plain_chunk(chunk)
    assert not relay._whole_plain_chunk(chunk[:-1])
    assert not relay._whole_plain_chunk(b"0x" + chunk)  # not digits alone
    assert not relay._whole_plain_chunk(b"e\r\ndata: [DONE]\n\n\r\n")
    got, _, _ = _through_tap([chunk, chunk, chunk + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"])
    assert got.startswith(chunk + b"38\r\n")  # the first as it came; the held one re-framed


def test_a_bad_chunk_is_an_upstream_error() -> None:
    for bad in (b"zz\r\ndata: x\n\n\r\n", b"3\r\nabcd\r\n", b"1" * 5000):
        resp, cycle = _Resp(), _Cycle()
        tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]
        tap.data_received(bad)
        assert isinstance(tap._error, UpstreamError), bad


def test_a_stream_ending_while_the_client_is_slow_hands_back_a_reading_connection() -> None:
    """The read that brings the end may also find the client's buffer full (reading paused):
    the connection goes back to the pool reading again, or its next answer would hang."""
    resp, cycle = _Resp(), _Cycle()
    cycle.flow.write_paused = True
    tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]
    ev = b'data: {"x": 1}\n\n'
    resp._conn.buf += b"%x\r\n%b\r\n" % (len(ev), ev) + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    asyncio.run(tap.run())
    assert resp._conn.transport.protocol is resp._conn
    assert resp._conn.transport.reading
    assert bytes(resp._conn.buf) == b"0\r\n\r\n"
    assert _dechunk(b"".join(cycle.transport.out) + b"0\r\n\r\n").endswith(b"[DONE]\n\n")


def test_a_whole_answer_that_came_before_the_tap_with_the_close_is_served_whole() -> None:
    """An engine may send its whole answer and close before the tap takes over: the buffered
    body is the answer, not a break; closed before the body ended, it is a break."""
    ev = b'data: {"x": 1}\n\n'
    whole = b"%x\r\n%b\r\n" % (len(ev), ev) + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    resp, cycle = _Resp(), _Cycle()
    tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]
    resp._conn.buf += whole
    resp._conn.eof = True
    asyncio.run(tap.run())
    assert tap._error is None
    assert _dechunk(b"".join(cycle.transport.out) + b"0\r\n\r\n").endswith(b"[DONE]\n\n")
    resp, cycle = _Resp(), _Cycle()
    tap = relay.StreamTap(resp, SseRelay(_last), cycle)  # type: ignore[arg-type]
    resp._conn.buf += whole[: len(whole) // 2]
    resp._conn.eof = True
    with pytest.raises(UpstreamError, match="mid-answer"):
        asyncio.run(tap.run())
