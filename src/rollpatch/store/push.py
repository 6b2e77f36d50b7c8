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

The asking relay also says what it already holds: ``&have=T,T,...`` names, among the
objects the upstream may push (those of the newest version it learned of from the upstream,
announced or not), the ones in its cache: a manifest by its version number, an object by the
BLAKE3 in its key. The upstream leaves those out of the push, so a version's bytes cross the
WAN once even when the asking relay's ``after`` has not moved past it (its watch restarted,
or it could not announce the version and asks again). At most :data:`MAX_HAVE` tokens; the
upstream refuses a malformed list (400), and a lying list can only make it push less (what
is not pushed is fetched as before).
"""

from __future__ import annotations

import re
import threading
import time

from ..errors import ConfigError, StoreError
from ..layout import manifest_version, object_hash
from .base import validate_key

__all__ = [
    "MAX_HAVE",
    "MAX_PUSHED",
    "PUSHED_TTL_S",
    "PUSH_HEADER",
    "PushedBytes",
    "frame_push",
    "have_token",
    "parse_have",
    "split_push",
]

#: Header of a pushed answer (its presence means the body is framed).
PUSH_HEADER = "X-Rollpatch-Push"
#: Most objects one pushed answer carries (a manifest and its step patch objects).
MAX_PUSHED = 17
#: Longest header value accepted (keys are at most ~200 characters each).
MAX_HEADER_CHARS = 16 * 1024
_PART = re.compile(r"([^=\s]+)=(\d{1,15})")
#: Most tokens in a ``have`` list (a push carries at most :data:`MAX_PUSHED` objects).
MAX_HAVE = MAX_PUSHED
_TOKEN = re.compile(r"[0-9]{1,16}|[0-9a-f]{64}")


def have_token(key: str) -> str | None:
    """The ``have`` token of ``key``: a manifest's version number, an object's BLAKE3 (None
    for other keys, which are never pushed)."""
    mv = manifest_version(key)
    if mv is not None:
        return str(mv[1])
    return object_hash(key)


def parse_have(text: str) -> frozenset[str]:
    """The tokens of a ``have`` query value (empty: none); :class:`ValueError` when it is
    not a comma-separated list of at most :data:`MAX_HAVE` tokens."""
    if not text:
        return frozenset()
    tokens = text.split(",", MAX_HAVE)
    if len(tokens) > MAX_HAVE or not all(_TOKEN.fullmatch(t) for t in tokens):
        raise ValueError(
            f"have: at most {MAX_HAVE} comma-separated version numbers or BLAKE3 hashes"
        )
    return frozenset(str(int(t)) if len(t) <= 16 else t for t in tokens)


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


#: Seconds pushed bytes wait for their read (:class:`PushedBytes`): the reads follow the
#: answer at once; a LATEST kept longer would be older than the relay's.
PUSHED_TTL_S = 2.0


class PushedBytes:
    """What the last long-poll answer pushed to a relay client, by key: each served to the
    next read of its key, all dropped :data:`PUSHED_TTL_S` after the answer (then the reads ask
    the relay again). A new answer replaces what an earlier one left unread."""

    def __init__(self) -> None:
        self._by_key: dict[str, bytes] = {}
        self._at = 0.0
        self._lock = threading.Lock()

    def hold(self, by_key: dict[str, bytes]) -> None:
        with self._lock:
            self._by_key, self._at = dict(by_key), time.monotonic()

    def take(self, key: str) -> bytes | None:
        with self._lock:
            if self._by_key and time.monotonic() - self._at > PUSHED_TTL_S:
                self._by_key = {}
            return self._by_key.pop(key, None)
