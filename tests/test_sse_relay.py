"""SseRelay's pass-through of whole events (the sidecar's per-event path) against its line
by line reference: the same bytes out for any stream and any split (issue 10)."""

from __future__ import annotations

import random

from rollpatch.serving.streaming import SseRelay

EVENTS = [
    b'data: {"a": 1}\n\n',
    b'data: {"t": "line\\nbreak"}\n\n',  # an escaped line break inside a JSON string
    b'data:{"b":2}\n\n',
    b'data: {"d": "[DONE]"}\n\n',  # [DONE] inside a payload is not the end
    b": ping\n\n",  # comments and other fields are dropped
    b'event: x\ndata: {"c":3}\n\n',
    b"data: crlf\r\n\r\n",
    b"\n\n",
    b"data: e\ndata: f\n\n",  # two data lines: two events
]


def _relay() -> tuple[SseRelay, list[bytes]]:
    log: list[bytes] = []

    def last(line: bytes, done: bool) -> bytes:
        return b"LAST[" + line + (b"]done" if done else b"]open") + b"\n\n"

    return SseRelay(last, on_done=lambda: log.append(b"<on_done>")), log


def _run(blocks: list[bytes], fast: bool) -> bytes:
    relay, log = _relay()
    for block in blocks:
        log.append(relay.feed(block) if fast else b"".join(relay.events(block)))
    log.append(relay.finish())
    return b"".join(log)


def test_whole_events_pass_through_as_they_came_less_the_held_last() -> None:
    relay, _ = _relay()
    block = b'data: {"a": 1}\n\ndata: {"b": 2}\n\n'
    assert relay.feed(block) == b'data: {"a": 1}\n\n'  # the last one is held back
    assert relay.feed(b"data: [DONE]\n\n") == b'LAST[data: {"b": 2}]done\n\ndata: [DONE]\n\n'


def test_feed_gives_the_bytes_of_the_line_by_line_reference_for_any_split() -> None:
    rng = random.Random(10)
    for _ in range(5000):
        events = [rng.choice(EVENTS) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.7:
            events.append(b"data: [DONE]\n\n")
        stream = b"".join(events)
        cuts = sorted(rng.sample(range(len(stream) + 1), min(len(stream) + 1, rng.randint(0, 5))))
        blocks, prev = [], 0
        for c in cuts:
            blocks.append(stream[prev:c])
            prev = c
        blocks.append(stream[prev:])
        assert _run(blocks, fast=True) == _run(blocks, fast=False), blocks
