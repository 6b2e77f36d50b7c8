"""``rp.ctxgolomb.v2`` in numpy: the executable reference of the native coder.

The model is v1's (docs/patch-format.md §4): changed positions coded per context of the old
element as ranks inside the context, outward flags, per-context "|step| > 1" flags and
exp-Golomb tails. v2 (§4b) codes each chunk of ``CHUNK`` elements on its own and lists
every context's size ``n_c`` in the chunk's params, so a decoder needs one pass over the base
(no histogram pass) and chunks decode in parallel. ``rollpatch.native`` produces the same
bytes; tests hold the two to that on every kind.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from ..errors import PatchDecodeError
from ..kinds import Kind
from .bits import (
    FixedReader,
    FixedWriter,
    UnaryReader,
    UnaryWriter,
    decode_expgolomb,
    decode_sequence,
    encode_expgolomb,
    encode_sequence,
    expgolomb_cost,
    read_varint,
    write_varint,
)

__all__ = ["CHUNK", "code_streams", "decode_ref", "encode_ref", "signed_delta"]

CHUNK = 1 << 20
_CODEC = "rp.ctxgolomb.v2"


def _consts(kind: Kind) -> tuple[int, int]:
    return 1 << (kind.bits - 1), (1 << kind.bits) - 1


def _key(kind: Kind, x: np.ndarray) -> np.ndarray:
    s, mask = _consts(kind)
    x = x.astype(np.uint64)
    if kind.order == "signmag":
        return np.where((x & np.uint64(s)) != 0, ~x & np.uint64(mask), x | np.uint64(s))
    if kind.order == "twos":
        return x ^ np.uint64(s)
    return x


def _unkey(kind: Kind, y: np.ndarray) -> np.ndarray:
    s, mask = _consts(kind)
    if kind.order == "signmag":
        return np.where((y & np.uint64(s)) != 0, y ^ np.uint64(s), ~y & np.uint64(mask))
    if kind.order == "twos":
        return y ^ np.uint64(s)
    return y


def _negative(kind: Kind, old: np.ndarray) -> np.ndarray:
    if kind.order == "unsigned":
        return np.zeros(old.shape, dtype=bool)
    return (old.astype(np.uint64) & np.uint64(1 << (kind.bits - 1))) != 0


def signed_delta(kind: Kind, old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(magnitude ≥ 1 as uint64, outward flag) of each change (spec §3)."""
    s, mask = _consts(kind)
    d = (_key(kind, new) - _key(kind, old)) & np.uint64(mask)
    positive = d < np.uint64(s)
    mag = np.where(positive, d, (np.uint64(0) - d) & np.uint64(mask))
    return mag, positive ^ _negative(kind, old)


def _contexts(kind: Kind, elems: np.ndarray, single: bool) -> np.ndarray:
    if single:
        return np.zeros(elems.size, dtype=np.uint8)
    mask = (1 << kind.ctx_bits) - 1
    return ((elems.astype(np.uint64) >> np.uint64(kind.ctx_shift)) & np.uint64(mask)).astype(
        np.uint8
    )


def _best_order(tail: np.ndarray, bits: int) -> int:
    best, cost = 0, expgolomb_cost(tail, 0)
    for k in range(1, min(bits, 63)):
        c = expgolomb_cost(tail, k)
        if c >= cost:
            break
        best, cost = k, c
    return best


def _encode_chunk(
    kind: Kind, ctx: np.ndarray, pos: np.ndarray, old: np.ndarray, new: np.ndarray
) -> bytes:
    if pos.size == 0:
        return b""
    sizes = np.bincount(ctx, minlength=256)
    order = np.argsort(ctx, kind="stable")
    inv = np.empty(ctx.size, dtype=np.int64)
    inv[order] = np.arange(ctx.size)
    starts = np.cumsum(sizes) - sizes
    pctx = ctx[pos]
    ranks = inv[pos] - starts[pctx]
    mag, outward = signed_delta(kind, old, new)
    ids = np.flatnonzero(np.bincount(pctx, minlength=256))
    members = [np.flatnonzero(pctx == c) for c in ids]
    return code_streams(
        kind,
        [int(c) for c in ids],
        [int(sizes[c]) for c in ids],
        [ranks[m] for m in members],
        members,
        mag,
        outward,
        with_sizes=True,
    )


def code_streams(
    kind: Kind,
    ids: Sequence[int],
    sizes: Sequence[int],
    ranks: Sequence[np.ndarray],
    members: Sequence[np.ndarray],
    mag: np.ndarray,
    outward: np.ndarray,
    *,
    with_sizes: bool,
) -> bytes:
    """Params, unary and fixed streams of docs/patch-format.md §4 (v1) or §4b (v2, whose
    params also list each context's size ``n_c``), in that order of coding.

    ``ids``: the listed contexts, increasing; per context its size, the sorted ranks of its
    changes and ``members`` (indices of its changes among all, position order); ``mag`` and
    ``outward`` per change (:func:`signed_delta`).
    """
    bigs = [np.flatnonzero(mag[m] > np.uint64(1)) for m in members]
    tails = [mag[m[b]] - np.uint64(2) for m, b in zip(members, bigs)]
    orders = [_best_order(t, kind.bits) for t in tails]
    params = bytearray()
    write_varint(params, len(ids))
    for c, n_c, m, b, eg in zip(ids, sizes, members, bigs, orders):
        row = (
            (int(c), n_c, int(m.size), int(b.size), eg)
            if with_sizes
            else (int(c), int(m.size), int(b.size), eg)
        )
        for v in row:
            write_varint(params, v)
    write_varint(params, int(outward.sum()))
    uw, fw = UnaryWriter(), FixedWriter()
    for r, n_c in zip(ranks, sizes):
        encode_sequence(r, n_c, uw, fw)
    encode_sequence(np.flatnonzero(outward), int(mag.size), uw, fw)
    for m, b in zip(members, bigs):
        encode_sequence(b, int(m.size), uw, fw)
    for t, eg in zip(tails, orders):
        encode_expgolomb(t, eg, uw, fw)
    unary = uw.getvalue()
    out = bytearray()
    write_varint(out, len(params))
    out += params
    write_varint(out, len(unary))
    out += unary
    out += fw.getvalue()
    return bytes(out)


def encode_ref(
    kind: Kind,
    base: np.ndarray,
    single: bool,
    positions: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
) -> bytes:
    """Payload of one delta tensor: per chunk, a varint length and the chunk body."""
    out = bytearray()
    n = base.size
    bounds = np.searchsorted(positions, np.arange(0, n + CHUNK, CHUNK))
    for i, start in enumerate(range(0, n, CHUNK)):
        lo, hi = bounds[i], bounds[i + 1]
        ctx = _contexts(kind, base[start : start + CHUNK], single)
        body = _encode_chunk(kind, ctx, positions[lo:hi] - start, old[lo:hi], new[lo:hi])
        write_varint(out, len(body))
        out += body
    return bytes(out)


def _fail(what: str) -> PatchDecodeError:
    return PatchDecodeError(what, codec=_CODEC)


def _params(body: memoryview, kind: Kind, single: bool, n: int) -> tuple[list[list[int]], int, int]:
    plen, p = read_varint(body, 0)
    if p + plen > len(body):
        raise _fail("params overrun the chunk")
    end, vals = p + plen, []
    while p < end:
        v, p = read_varint(body, p)
        vals.append(v)
    ncontexts = 1 if single else 1 << kind.ctx_bits
    if p != end or not vals or not 1 <= vals[0] <= ncontexts or len(vals) != 5 * vals[0] + 2:
        raise _fail("wrong number of params")
    rows = [vals[1 + 5 * i : 6 + 5 * i] for i in range(vals[0])]
    top = min(kind.bits, 63)
    ids = [r[0] for r in rows]
    if (
        any(b <= a for a, b in itertools.pairwise(ids))
        or ids[-1] >= ncontexts
        or any(not (nc <= n and 1 <= k <= nc and b <= k and eg < top) for _, nc, k, b, eg in rows)
    ):
        raise _fail("invalid context parameters")
    total = sum(r[1] for r in rows)
    if total > n or (single and total != n) or vals[-1] > sum(r[2] for r in rows):
        raise _fail("invalid context sizes or outward count")
    return rows, vals[-1], end


def _decode_chunk(
    kind: Kind, elems: np.ndarray, single: bool, body: memoryview
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = elems.size
    rows, k_out, upos = _params(body, kind, single, n)
    ulen, q = read_varint(body, upos)
    if q + ulen > len(body):
        raise _fail("unary stream overruns the chunk")
    ur, fr = UnaryReader(body[q : q + ulen]), FixedReader(body[q + ulen :])
    ctx = _contexts(kind, elems, single)
    sizes = np.bincount(ctx, minlength=256)
    if any(sizes[c] != nc for c, nc, _, _, _ in rows):
        raise PatchDecodeError(
            "context sizes differ from the base: not the patch's base", codec=_CODEC
        )
    order = np.argsort(ctx, kind="stable")
    starts = np.cumsum(sizes) - sizes
    per = [
        order[starts[c] : starts[c] + nc][decode_sequence(nc, k, ur, fr)] for c, nc, k, _, _ in rows
    ]
    positions = np.sort(np.concatenate(per)) if per else np.zeros(0, np.int64)
    k = positions.size
    outward = np.zeros(k, dtype=bool)
    outward[decode_sequence(k, k_out, ur, fr)] = True
    pctx = ctx[positions]
    members = [np.flatnonzero(pctx == c) for c, _, _, _, _ in rows]
    bigs = [decode_sequence(int(m.size), b, ur, fr) for m, (_, _, _, b, _) in zip(members, rows)]
    mag = np.ones(k, dtype=np.uint64)
    width = min(kind.bits, 63)
    for m, big, (_, _, _, _, eg) in zip(members, bigs, rows):
        mag[m[big]] = decode_expgolomb(big.size, eg, width, ur, fr) + np.uint64(2)
    ur.finish()
    fr.finish()
    if (mag > np.uint64(1 << (kind.bits - 1))).any():
        raise _fail("delta magnitude beyond the word range")
    old = elems[positions]
    _, mask = _consts(kind)
    positive = outward ^ _negative(kind, old)
    key = _key(kind, old)
    key_new = np.where(positive, key + mag, key - mag) & np.uint64(mask)
    return positions.astype(np.int64), old, _unkey(kind, key_new).astype(elems.dtype)


def decode_ref(
    kind: Kind, elems: np.ndarray, single: bool, payload: memoryview, changed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_ref` against the base elements."""
    n, p = elems.size, 0
    parts = []
    for start in range(0, n, CHUNK):
        blen, p = read_varint(payload, p)
        if p + blen > len(payload):
            raise _fail("chunk overruns the payload")
        if blen:
            pos, old, new = _decode_chunk(
                kind, elems[start : start + CHUNK], single, payload[p : p + blen]
            )
            parts.append((pos + start, old, new))
        p += blen
    if p != len(payload):
        raise _fail("bytes after the last chunk")
    if not parts:
        raise _fail("no changes in a delta payload")
    pos = np.concatenate([a for a, _, _ in parts])
    if pos.size != changed:
        raise _fail("changed count does not match the header")
    return pos, np.concatenate([b for _, b, _ in parts]), np.concatenate([c for _, _, c in parts])
