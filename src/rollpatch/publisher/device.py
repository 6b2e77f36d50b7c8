"""The trainer's O(N) work in torch, on the device where the master weights live.

Everything that reads every element of a tensor runs here, on whatever device the words are
on (a GPU in production, the CPU in tests): the BF16 cast, the compare of two versions, the
contexts, their histograms and ranks per chunk (the records ``rp.ctxgolomb.v2`` codes from,
``patch.codec_v2.ChunkRecords``), and the ``rp.sum128`` state of a tensor. Only
O(changed) arrays cross to the host. The code is the same on every device; the numpy
reference (``patch/ctxv2.py``, ``view._sum128_numpy``) is what tests hold it to.

Words are kept in the signed torch integer of their width (``uint8``, ``int16``, ``int32``,
``int64``): torch's unsigned 16/32/64-bit types lack most kernels. Contexts are taken with
arithmetic shifts, which is exact because every kind has ``ctx_shift + ctx_bits`` below the
word width. Torch is imported here only; ``import rollpatch`` never needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import native
from ..kinds import DTYPE_BYTES, Kind
from ..patch.codec_v2 import ChunkRecords
from ..view import Tensor, sum128_digest
from .cast import bf16_words

__all__ = [
    "CHUNK",
    "DeviceTensor",
    "TensorRecords",
    "bf16_words",
    "from_host",
    "records",
    "scatter_elements",
    "sum128_state",
    "sum128_update",
    "to_host",
]

CHUNK = native.CHUNK
_POS_BITS = CHUNK.bit_length() - 1  # a position inside a chunk fits in this many bits
_TORCH_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_M64 = (1 << 64) - 1
#: rp.sum128.v1 constants (docs/patch-format.md §7; ``view._sum128_numpy`` is the reference).
_SUM_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_SUM_S = (0x243F6A8885A308D3, 0x13198A2E03707344)
_SUM_ROT = (32, 17)
#: 8-byte words per step of the device sum (8 MiB temporaries: larger fresh
#: allocations fault in their pages on every call).
_SUM_SPLIT = 1 << 20


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as ``x`` (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def torch_word_dtype(kind: Kind) -> torch.dtype:
    """The torch dtype a kind's words are kept in on the device."""
    return _TORCH_WORDS[DTYPE_BYTES[kind.dtype]]


@dataclass(eq=False)
class DeviceTensor:
    """One served tensor whose words live on a torch device.

    ``words`` is flat and contiguous, ``kind``'s width; ``state`` its rp.sum128 state (None
    until known: then ``digest`` computes it on the device), from which the tensor digest
    follows without reading the words again.
    """

    kind: Kind
    shape: tuple[int, ...]
    words: torch.Tensor
    state: tuple[int, int] | None

    @property
    def nbytes(self) -> int:
        return int(self.words.numel()) * self.words.element_size()

    @property
    def n_elements(self) -> int:
        return int(self.words.numel()) * (2 if self.kind.packed else 1)

    def digest(self) -> str:
        if self.state is None:
            self.state = sum128_state(self.words)
        return sum128_digest(self.kind.dtype, self.shape, self.nbytes, self.state)

    def host(self) -> Tensor:
        """A host :class:`Tensor` of the words (a copy off the CPU, shared memory on it)."""
        return Tensor(self.kind, self.shape, to_host(self.words, self.kind.word_dtype))

    @classmethod
    def make(cls, kind: Kind, shape: tuple[int, ...], words: torch.Tensor) -> DeviceTensor:
        """Wrap flat words, computing their rp.sum128 state on their device."""
        return cls(kind, tuple(int(d) for d in shape), words, sum128_state(words))


def to_host(x: torch.Tensor, dtype: np.dtype | type) -> np.ndarray:
    """A host numpy array of ``x`` reinterpreted as ``dtype`` (same width)."""
    return x.detach().cpu().numpy().view(dtype)


def from_host(data: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """Host words → flat device words of the same width (``torch_word_dtype``)."""
    flat = np.ascontiguousarray(data).reshape(-1)
    signed = flat.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[flat.itemsize])
    return torch.from_numpy(signed.copy()).to(device)


def _terms(w: torch.Tensor, j: torch.Tensor, lane: int) -> torch.Tensor:
    """rp.sum128 terms of 8-byte words ``w`` (int64) at word indices ``j`` for one lane."""
    k = torch.tensor(_signed(_SUM_K[lane]), dtype=torch.int64, device=w.device)
    x = torch.mul(j, k).add_(_signed(_SUM_S[lane])).bitwise_xor_(w)
    r = _SUM_ROT[lane]
    term = (x & 0xFFFFFFFF).mul_((x >> 32).bitwise_and_(0xFFFFFFFF))
    return term.add_((w << r).bitwise_or_((w >> (64 - r)).bitwise_and_((1 << r) - 1)))


def sum128_state(words: torch.Tensor) -> tuple[int, int]:
    """The rp.sum128 state of a flat contiguous tensor's bytes, computed on its device.

    int64 arithmetic wraps modulo 2^64 on every torch device, which is the sum's ring; the
    logical shifts of the reference are arithmetic shifts masked back to their width.
    """
    raw = words.detach().reshape(-1).view(torch.uint8)
    if raw.numel() == 0:
        return 0, 0
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    w = raw.view(torch.int64)
    sums = [0, 0]
    for start in range(0, w.numel(), _SUM_SPLIT):
        ws = w[start : start + _SUM_SPLIT]
        j = torch.arange(start, start + ws.numel(), dtype=torch.int64, device=w.device)
        for lane in (0, 1):
            sums[lane] += int(_terms(ws, j, lane).sum())
    return sums[0] & _M64, sums[1] & _M64


def _words_at(raw: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The 8-byte little-endian words ``j`` of bytes ``raw``, zero-padded past the end."""
    if raw.numel() % 8 == 0:
        return raw.view(torch.int64)[j]
    idx = (j * 8).unsqueeze(1) + torch.arange(8, device=raw.device)
    b = raw[idx.clamp(max=raw.numel() - 1)].to(torch.int64)
    b.masked_fill_(idx >= raw.numel(), 0)
    shifts = torch.arange(0, 64, 8, device=raw.device)
    return (b << shifts).sum(dim=1)


def sum128_update(
    state: tuple[int, int],
    before: torch.Tensor,
    after: torch.Tensor,
    positions: torch.Tensor,
    kind: Kind,
) -> tuple[int, int]:
    """The rp.sum128 state of ``after`` from that of ``before`` (same layout) when they differ
    only at element ``positions`` (device int64): O(changed) work, exact in the ring."""
    if positions.numel() == 0:
        return state
    width = DTYPE_BYTES[kind.dtype]
    byte = positions >> 1 if kind.packed else positions * width
    j = torch.unique(byte >> 3)
    ra = before.detach().reshape(-1).view(torch.uint8)
    rb = after.detach().reshape(-1).view(torch.uint8)
    wa, wb = _words_at(ra, j), _words_at(rb, j)
    out = []
    for lane in (0, 1):
        d = _terms(wb, j, lane).sub_(_terms(wa, j, lane))
        out.append((state[lane] + int(d.sum())) & _M64)
    return out[0], out[1]


def _elements(words: torch.Tensor, kind: Kind, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of a tensor (nibbles, low first, for packed kinds)."""
    if not kind.packed:
        return words[start:stop]
    b = words[start // 2 : (stop + 1) // 2]
    return torch.stack([b & 0x0F, b >> 4], dim=1).reshape(-1)[start % 2 : start % 2 + stop - start]


@dataclass
class TensorRecords:
    """One tensor's changes, on the host: global ``positions`` (int64, increasing), ``old`` and
    ``new`` elements (``kind.elem_dtype``), and per chunk the coder's records (None: no
    change in that chunk)."""

    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray
    chunks: list[ChunkRecords | None]
    state: tuple[int, int] | None = None
    """The rp.sum128 state of the new tensor, when the old one's was given."""

    @property
    def nbytes(self) -> int:
        """Bytes that crossed from the device for these records."""
        per = [c for c in self.chunks if c is not None]
        return sum(
            c.sizes.nbytes
            + c.positions.nbytes
            + c.contexts.nbytes
            + c.ranks.nbytes
            + c.old.nbytes
            + c.new.nbytes
            for c in per
        )


def records(
    kind: Kind, old: torch.Tensor, new: torch.Tensor, state: tuple[int, int] | None = None
) -> TensorRecords:
    """Compare two same-layout word tensors on their device; the changes and coder records.

    With ``state`` (the rp.sum128 state of ``old``), the new tensor's state is updated from
    the changed words (O(changed)) and returned with the records.

    Per chunk of ``CHUNK`` elements: changed positions (``nonzero``), and only for chunks with
    a change, contexts of the old elements, their histogram (``bincount``) and each change's
    rank inside its context (a binary search among the (context, position) keys of a stable
    sort of the contexts). Device arrays are concatenated and cross to the host once per
    tensor.
    """
    n = int(old.numel()) * (2 if kind.packed else 1)
    _, _, shift, bits = native.kind_tuple(kind, n)
    mask = (1 << bits) - 1
    dev = old.device
    found: list[
        tuple[
            int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
        ]
    ] = []
    for ci, s in enumerate(range(0, n, CHUNK)):
        e = min(s + CHUNK, n)
        eo, en = _elements(old, kind, s, e), _elements(new, kind, s, e)
        pos = torch.nonzero(eo != en).reshape(-1)
        if pos.numel() == 0:
            continue
        if bits:
            ctx = ((eo >> shift) & mask).to(torch.uint8)
        else:
            ctx = torch.zeros(e - s, dtype=torch.uint8, device=dev)
        sizes = torch.bincount(ctx, minlength=256)
        # (context, position) keys in stable-sorted order are increasing, so a change's
        # index among them is a binary search (a scatter of the inverse is 4x slower on CPUs)
        sctx, order = torch.sort(ctx, stable=True)
        keys = (sctx.to(torch.int32) << _POS_BITS) | order.to(torch.int32)
        pctx = ctx[pos]
        at = torch.searchsorted(keys, (pctx.to(torch.int32) << _POS_BITS) | pos.to(torch.int32))
        starts = torch.cumsum(sizes, 0) - sizes
        ranks = at - starts[pctx.long()]
        found.append(
            (ci, sizes, pos.to(torch.int32), pctx, ranks.to(torch.int32), eo[pos], en[pos])
        )
    out = _to_host(kind, n, found)
    if state is not None:
        where = [f[2].long() + f[0] * CHUNK for f in found]
        flat = torch.cat(where) if where else torch.zeros(0, dtype=torch.int64, device=dev)
        out.state = sum128_update(state, old, new, flat, kind)
    return out


def _to_host(kind: Kind, n: int, found: list[tuple[Any, ...]]) -> TensorRecords:
    edt = kind.elem_dtype
    chunks: list[ChunkRecords | None] = [None] * (-(-n // CHUNK))
    if not found:
        empty = np.zeros(0, dtype=np.int64)
        return TensorRecords(empty, np.zeros(0, edt), np.zeros(0, edt), chunks)
    counts = [int(f[2].numel()) for f in found]
    cols = [torch.cat([f[i] for f in found]) for i in range(2, 7)]
    sizes = to_host(torch.stack([f[1] for f in found]), np.int64)
    pos, ctx, ranks = (to_host(c, dt) for c, dt in zip(cols[:3], (np.int32, np.uint8, np.int32)))
    old, new = to_host(cols[3], edt), to_host(cols[4], edt)
    offsets = np.repeat(np.array([f[0] * CHUNK for f in found], dtype=np.int64), counts)
    positions = pos.astype(np.int64) + offsets
    at = 0
    for row, (f, k) in enumerate(zip(found, counts)):
        sl = slice(at, at + k)
        chunks[f[0]] = ChunkRecords(sizes[row], pos[sl], ctx[sl], ranks[sl], old[sl], new[sl])
        at += k
    return TensorRecords(positions, old, new, chunks)


def scatter_elements(
    words: torch.Tensor, kind: Kind, positions: np.ndarray, values: np.ndarray
) -> None:
    """Write host ``values`` at element ``positions`` of device ``words``, in place
    (read-modify-write of bytes, one parity at a time, for packed kinds)."""
    dev = words.device
    pos = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(dev)
    wdt = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[words.element_size()]
    val = torch.from_numpy(
        np.ascontiguousarray(values).view(wdt)
        if not kind.packed
        else np.ascontiguousarray(values, dtype=np.uint8)
    ).to(dev)
    if not kind.packed:
        words[pos] = val
        return
    for parity, keep, shift in ((0, 0xF0, 0), (1, 0x0F, 4)):
        sel = (pos & 1) == parity
        idx = pos[sel] >> 1
        words[idx] = (words[idx] & keep) | (val[sel] << shift)
