"""The view digests (docs/patch-format.md §7): ``rp.sum128.v1``, a 128-bit additive checksum
at memory speed finalised with BLAKE3 over its state (the default; it guards against faults,
not forgers), and ``rp.blake3.v1`` (patch format 1); the root digest over the sorted (name,
tensor digest) pairs. :mod:`rollpatch.view` keeps them per tensor and per view."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Literal

import blake3
import numpy as np

from . import native

__all__ = [
    "DEFAULT_DIGEST",
    "DigestAlgo",
    "root_digest",
    "sum128",
    "sum128_at",
    "sum128_digest",
    "sum128_terms",
    "sum_add",
    "tensor_digest",
]

DigestAlgo = Literal["rp.sum128.v1", "rp.blake3.v1"]
DEFAULT_DIGEST: DigestAlgo = "rp.sum128.v1"
_TENSOR_DOMAIN = {
    "rp.blake3.v1": b"rollpatch.tensor.v1\x00",
    "rp.sum128.v1": b"rollpatch.tensor.sum128.v1\x00",
}
_ROOT_DOMAIN = {"rp.blake3.v1": b"rollpatch.view.v1\x00", "rp.sum128.v1": b"rollpatch.view.v2\x00"}
_SUM_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_SUM_S = (0x243F6A8885A308D3, 0x13198A2E03707344)
_SUM_ROT = (32, 17)
_M64 = (1 << 64) - 1
#: Words per thread task when hashing one large tensor (the sum is additive over ranges).
_SUM_SPLIT = 1 << 23


def sum128_terms(words: np.ndarray, index: np.ndarray) -> tuple[int, int]:
    """rp.sum128 state contribution of 8-byte ``words`` (uint64) standing at word ``index``
    (uint64, same length): Σ of both lanes' per-word terms, mod 2^64 (§7.1). Sums over any
    words add up, so the change of a write is terms(after) - terms(before) of its words."""
    out = []
    with np.errstate(over="ignore"):
        for lane in (0, 1):
            x = words ^ (np.uint64(_SUM_S[lane]) + index * np.uint64(_SUM_K[lane]))
            r = np.uint64(_SUM_ROT[lane])
            term = (x & np.uint64(0xFFFFFFFF)) * (x >> np.uint64(32)) + (
                (words << r) | (words >> (np.uint64(64) - r))
            )
            out.append(int(term.sum(dtype=np.uint64)))
    return out[0], out[1]


def _sum128_numpy(raw: np.ndarray) -> tuple[int, int]:
    """Reference rp.sum128 state of bytes ``raw`` (uint8), zero-padded to 8-byte words."""
    pad = (-raw.size) % 8
    w = np.concatenate([raw, np.zeros(pad, np.uint8)]).view("<u8") if pad else raw.view("<u8")
    return sum128_terms(w, np.arange(w.size, dtype=np.uint64))


def sum_add(state: tuple[int, int], change: tuple[int, int]) -> tuple[int, int]:
    """An rp.sum128 state plus a change (each lane modulo 2^64): the state is additive."""
    return (state[0] + change[0]) & _M64, (state[1] + change[1]) & _M64


def sum128(data: np.ndarray) -> tuple[int, int]:
    """The rp.sum128 state (two 64-bit sums) of a contiguous array's bytes."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    core = native.core
    if core is None:
        return _sum128_numpy(raw)
    words = (raw.size + 7) // 8
    if words <= _SUM_SPLIT:
        return tuple(core.sum128(raw, 0, words))
    parts = native.parallel_map(
        lambda w0: core.sum128(raw, w0, min(_SUM_SPLIT, words - w0)),
        list(range(0, words, _SUM_SPLIT)),
    )
    return sum(a for a, _ in parts) & _M64, sum(b for _, b in parts) & _M64


def sum128_at(words: np.ndarray, j0: int, row_words: int = 0, j_stride: int = 0) -> tuple[int, int]:
    """The rp.sum128 terms of words held apart from their tensor (a tensor-parallel rank's
    block): ``words`` (C-contiguous, whole 8-byte words) as rows of ``row_words`` words (0:
    one row of all), row r being the tensor's words ``j0 + r * j_stride`` on. Natively at
    memory speed; numpy's :func:`sum128_terms` (the reference) without the core."""
    raw = np.ascontiguousarray(words).reshape(-1).view(np.uint8)
    if raw.size % 8 or (row_words and (raw.size // 8) % row_words):
        raise ValueError("not whole rows of whole 8-byte words")
    core = native.core
    if core is not None:
        return tuple(core.sum128_at(raw, j0, row_words, j_stride))
    n = raw.size // 8
    width = row_words or n
    rows = n // width if width else 0
    index = (
        np.arange(rows, dtype=np.uint64)[:, None] * np.uint64(j_stride)
        + np.uint64(j0)
        + np.arange(width, dtype=np.uint64)[None, :]
    )
    return sum128_terms(raw.view("<u8"), index.reshape(-1))


@functools.lru_cache(maxsize=4096)
def _header(algo: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    """The digest's domain, dtype and shape bytes (cached: a view has few distinct layouts,
    and every apply digests each touched tensor from its state)."""
    return _TENSOR_DOMAIN[algo] + f"{dtype}|{','.join(str(d) for d in shape)}\x00".encode()


def sum128_digest(dtype: str, shape: tuple[int, ...], nbytes: int, state: tuple[int, int]) -> str:
    """The rp.sum128.v1 digest of a tensor from its sum state (docs/patch-format.md §7)."""
    return blake3.blake3(
        _header("rp.sum128.v1", dtype, shape)
        + nbytes.to_bytes(8, "little")
        + state[0].to_bytes(8, "little")
        + state[1].to_bytes(8, "little")
    ).hexdigest()


def tensor_digest(
    dtype: str, shape: tuple[int, ...], data: np.ndarray, algo: DigestAlgo = DEFAULT_DIGEST
) -> str:
    """Digest (64 hex) of one served tensor: dtype, shape and raw little-endian bytes."""
    if algo == "rp.sum128.v1":
        return sum128_digest(dtype, shape, int(data.nbytes), sum128(data))
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(_header(algo, dtype, shape))
    if data.size:
        h.update(memoryview(np.ascontiguousarray(data)).cast("B"))  # type: ignore[arg-type]
    return h.hexdigest()


def root_digest(tensor_digests: Mapping[str, str], algo: DigestAlgo = DEFAULT_DIGEST) -> str:
    """Root digest (hex) of a view from its per-tensor digests."""
    parts = [_ROOT_DOMAIN[algo]]
    for name in sorted(tensor_digests):  # the same bytes as one update each, hashed at once
        raw = name.encode()
        parts += (len(raw).to_bytes(4, "little"), raw, bytes.fromhex(tensor_digests[name]))
    return blake3.blake3(b"".join(parts)).hexdigest()
