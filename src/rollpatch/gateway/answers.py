"""What the gateway accepts from an island: bounded reads, and version labels checked against
the request's constraint before an answer reaches the client.

The gateway forwards the constraint and each sidecar enforces it, but a buggy or hostile
island could still answer ``200`` under a version the caller did not ask for, or with no
labels at all. Nothing it says is passed on unchecked: a non-streamed answer is read whole
(within ``max_answer_bytes``), its labels checked, then forwarded; a stream's head label is
checked before its first byte goes out, and every labelled event as it passes (a bad one ends
the stream with an error event, never ``[DONE]``). A refused answer is a :class:`BadAnswer`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx

from .. import jsonsafe
from ..protocol import HEADER_END, HEADER_START
from ..types import Constraint

__all__ = ["BadAnswer", "StreamLabels", "check_answer", "read_bounded", "stream_lines"]

#: Completion answers nest a few levels (choices → logprobs → top tokens); far deeper is hostile.
MAX_ANSWER_DEPTH = 64

BadKind = Literal["bad_label", "too_large"]


class BadAnswer(Exception):
    """An island's answer the gateway does not pass on (``kind``: its metrics outcome)."""

    def __init__(self, message: str, kind: BadKind = "bad_label") -> None:
        super().__init__(message)
        self.kind: BadKind = kind


async def read_bounded(r: httpx.Response, limit: int, what: str) -> bytes:
    """The body of ``r`` (opened with ``stream=True``), read with a running total:
    :class:`BadAnswer` (``too_large``) as soon as it is known to exceed ``limit`` bytes (a
    ``Content-Length`` over it is refused before any byte of the body is read)."""
    length = r.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > limit:
        raise BadAnswer(
            f"{what} of {int(length):,} bytes is over the limit of {limit:,}", "too_large"
        )
    parts: list[bytes] = []
    total = 0
    async for part in r.aiter_bytes():
        total += len(part)
        if total > limit:
            raise BadAnswer(f"{what} is over the limit of {limit:,} bytes", "too_large")
        parts.append(part)
    return b"".join(parts)


async def stream_lines(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[str]:
    """The lines of an SSE stream (split at ``\\n``; a ``\\r`` left in a line is handled by
    the relay), none longer than ``limit`` bytes: a longer one is :class:`BadAnswer`
    (``too_large``) before it is buffered whole."""
    partial = b""
    async for chunk in chunks:
        data = partial + chunk if partial else chunk
        start = 0
        while (nl := data.find(b"\n", start)) >= 0:
            yield data[start:nl].decode("utf-8", "replace")
            start = nl + 1
        partial = data[start:]
        if len(partial) > limit:
            raise BadAnswer(
                f"a line of the stream is over the limit of {limit:,} bytes", "too_large"
            )
    if partial:
        yield partial.decode("utf-8", "replace")


def _int_label(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _header_label(headers: httpx.Headers, name: str) -> int | None | Literal["absent"]:
    if name not in headers:
        return "absent"
    text = headers[name].strip()
    return int(text) if text.isascii() and text.isdigit() else None


def check_versions(start: int, end: int | None, c: Constraint, latest: int | None) -> None:
    """:class:`BadAnswer` unless a response labelled ``start``..``end`` satisfies ``c``.

    ``latest``: the island's own LATEST as the gateway knew it before sending (None: not
    known, and ``max_lag`` is not checked). A sidecar's LATEST only moves forward, so an honest
    island never answers below ``latest - max_lag``; ``version_end`` null is the sidecar saying
    it cannot vouch for the version at the end (docs/sidecar.md), not a violation."""
    if end is not None and end < start:
        raise BadAnswer(f"labels out of order: version_start {start} > version_end {end}")
    if c.exact_version is not None and (start, end) not in (
        (c.exact_version, c.exact_version),
        (c.exact_version, None),
    ):
        raise BadAnswer(f"labelled {start}..{end}, the request asked for exactly {c.exact_version}")
    need = c.lowest_acceptable(latest if c.max_lag is not None else None)
    if start < need:
        raise BadAnswer(f"labelled {start}, the request needs at least {need}")


def _body_labels(rp: Any) -> tuple[int, int | None]:
    if not isinstance(rp, dict):
        raise BadAnswer("no rollpatch version labels in the answer")
    start, end = _int_label(rp.get("version_start")), rp.get("version_end")
    if start is None or (end is not None and _int_label(end) is None):
        raise BadAnswer(f"unreadable version labels: {json.dumps(rp)[:120]}")
    return start, end


def check_answer(
    headers: httpx.Headers, raw: bytes, c: Constraint, latest: int | None
) -> dict[str, Any]:
    """The parsed body of a non-streamed ``200``, once its labels (body field and headers,
    which must agree) satisfy ``c``; else :class:`BadAnswer`."""
    if jsonsafe.nesting_depth(raw) > MAX_ANSWER_DEPTH:
        raise BadAnswer(f"the answer nests deeper than {MAX_ANSWER_DEPTH}")
    try:  # not jsonsafe's strict parse: engines legitimately answer -Infinity logprobs
        body = json.loads(raw)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError included
        raise BadAnswer("the answer is not JSON") from None
    if not isinstance(body, dict):
        raise BadAnswer("the answer is not a JSON object")
    start, end = _body_labels(body.get("rollpatch"))
    h_start, h_end = _header_label(headers, HEADER_START), _header_label(headers, HEADER_END)
    if h_start != start or h_end not in (end, "absent" if end is None else end):
        raise BadAnswer(
            f"the version headers ({h_start}, {h_end}) disagree with the body's ({start}, {end})"
        )
    check_versions(start, end, c, latest)
    return body


class StreamLabels:
    """The label checks of one stream: :meth:`head` before its first byte goes out, then
    :meth:`lines` around its lines (a bad labelled event, or an end with none, raises
    :class:`BadAnswer` before the relay sees that line)."""

    def __init__(self, c: Constraint, latest: int | None) -> None:
        self.c, self.latest = c, latest
        self.start: int | None = None
        self.labelled = False

    def head(self, headers: httpx.Headers) -> None:
        start = _header_label(headers, HEADER_START)
        if not isinstance(start, int):
            raise BadAnswer(f"the stream's {HEADER_START} header is missing or unreadable")
        end = _header_label(headers, HEADER_END)
        if end is None:
            raise BadAnswer(f"the stream's {HEADER_END} header is unreadable")
        check_versions(start, None if end == "absent" else end, self.c, self.latest)
        self.start = start

    async def lines(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        async for line in lines:
            if line.startswith("data:"):
                payload = line[5:].strip()
                if payload == "[DONE]":
                    self._end()
                elif '"rollpatch"' in payload:
                    self._event(payload)
            yield line
        self._end()

    def _event(self, payload: str) -> None:
        try:
            event = json.loads(payload)
        except ValueError:
            raise BadAnswer("a labelled event of the stream is not JSON") from None
        if not isinstance(event, dict) or "rollpatch" not in event:
            return  # the word in a text, not a label
        start, end = _body_labels(event["rollpatch"])
        if start != self.start:
            raise BadAnswer(f"the stream's labels say {start}, its header said {self.start}")
        check_versions(start, end, self.c, self.latest)
        self.labelled = True

    def _end(self) -> None:
        if not self.labelled:
            raise BadAnswer("the stream ended without version labels")
