"""Pushed answers to a long-poll of LATEST: the announced version's bytes in the same answer.

A relay downstream that long-polls LATEST (``?after=N&wait=S``) may add ``&push=B``: it accepts
up to ``B`` bytes of the announced version's manifest and step patch objects in the answer
itself. The upstream relay then answers, when it has them all cached and they fit, with

    X-Rollpatch-Push: <LATEST length> <key>=<length> <key>=<length> ...
    body: LATEST bytes, then each object's bytes, in the header's order

so they cross the WAN in the answer that announces the version instead of one round trip
after it (docs/relay.md, "Push"). A push is an optimisation only: the receiver checks every
pushed object exactly as one it fetched (objects against the BLAKE3 in their key, manifests
by signature and schema) before caching it, and what it does not accept it fetches as
before. Everything read from the header is bounded before it is used.
"""

from __future__ import annotations

import re

from ..errors import ConfigError, StoreError
from .base import validate_key

__all__ = ["MAX_PUSHED", "PUSH_HEADER", "frame_push", "split_push"]

#: Header of a pushed answer (its presence means the body is framed).
PUSH_HEADER = "X-Rollpatch-Push"
#: Most objects one pushed answer carries (a manifest and its step patch objects).
MAX_PUSHED = 17
#: Longest header value accepted (keys are at most ~200 characters each).
MAX_HEADER_CHARS = 16 * 1024
_PART = re.compile(r"([^=\s]+)=(\d{1,15})")


def frame_push(latest: bytes, parts: list[tuple[str, bytes]]) -> tuple[str, list[bytes]]:
    """The header value and body pieces of a pushed answer of ``latest`` and ``parts``."""
    if len(parts) > MAX_PUSHED:
        raise ValueError(f"at most {MAX_PUSHED} objects per push")
    header = " ".join([str(len(latest)), *(f"{k}={len(b)}" for k, b in parts)])
    return header, [latest, *(b for _, b in parts)]


def split_push(header: str, body: bytes, store: str) -> tuple[bytes, list[tuple[str, bytes]]]:
    """LATEST and the pushed ``(key, bytes)`` of a pushed answer; :class:`StoreError` when
    the header is malformed or its lengths do not add up to the body's."""

    def bad(why: str) -> StoreError:
        return StoreError(f"malformed pushed answer: {why}", store=store, header=header[:200])

    if len(header) > MAX_HEADER_CHARS:
        raise bad("header too long")
    fields = header.split()
    if not fields or not fields[0].isdigit() or len(fields) > MAX_PUSHED + 1:
        raise bad("expected '<LATEST length> <key>=<length> ...'")
    lengths, keys = [int(fields[0])], []
    for f in fields[1:]:
        m = _PART.fullmatch(f)
        if m is None:
            raise bad(f"part {f[:80]!r}")
        try:
            keys.append(validate_key(m.group(1)))
        except ConfigError as e:
            raise bad(f"key {m.group(1)[:80]!r}: {e.message}") from None
        lengths.append(int(m.group(2)))
    if sum(lengths) != len(body):
        raise bad(f"lengths add up to {sum(lengths)}, the body has {len(body)} bytes")
    view, at, out = memoryview(body), lengths[0], []
    for key, n in zip(keys, lengths[1:], strict=True):
        out.append((key, bytes(view[at : at + n])))
        at += n
    return body[: lengths[0]], out
