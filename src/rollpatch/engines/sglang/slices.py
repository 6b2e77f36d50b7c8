"""Tensor-parallel SGLang: digests of tensors no rank holds whole (numpy only).

At ``--tp-size`` > 1 SGLang's parallel layers give each rank a block of a checkpoint tensor:
whole rows of a column-parallel layer (``q/k/v``, ``gate/up``, the vocabulary), whole
columns of a row-parallel one (``o``, ``down``), everything of a replicated one (norms);
:mod:`rollpatch.engines.vllm.layout` derives which block from the model's own metadata. No
rank can hash such a tensor, but rp.sum128 (docs/patch-format.md §7) is a sum over the
tensor's 8-byte words, each term a function of the word and its *index in the tensor*. So
each rank sums the terms of the words it holds, at their global indices
(:func:`partial_state`), changes that sum by the terms of the words a patch rewrites
(:func:`partial_delta`, O(changed)), and the adapter adds the ranks' sums, each distinct block
once (KV heads replicated over ranks are held twice), after checking that the blocks tile the
tensor (:func:`combine`). A block must start and end on 8-byte words (true of every layer
width divisible by 4 for BF16); others are refused. vLLM's TP ranks use the same block sums
(:func:`rollpatch.engines.vllm.weights.ranks_state`, exchanged in a collective).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ...errors import EngineError
from ...kinds import get_kind
from ...view import root_digest, sum128_at, sum128_digest, sum128_terms
from ..vllm.layout import Placement, locate
from ..vllm.tensorblocks import extract

__all__ = [
    "Block",
    "aligned",
    "combine",
    "combine_state",
    "partial_delta",
    "partial_state",
    "word_map",
]

_M64 = (1 << 64) - 1
#: One rank's report for one tensor: ``[dim, src_start, length, s0, s1]``.
Block = list[int]


def _per(pl: Placement, itemsize: int) -> int:
    per = 8 // itemsize
    extent = pl.rows if pl.dim == 0 else pl.cols
    step = pl.cols if pl.dim == 0 else 1
    if pl.whole:
        return per  # the whole tensor: its words, zero-padded at the end as everywhere
    if (pl.src_start * step) % per or (pl.length * step) % per or (pl.dim == 1 and pl.cols % per):
        raise EngineError(
            "a tensor-parallel block does not start and end on 8-byte words",
            tensor=pl.name,
            dim=pl.dim,
            start=pl.src_start,
            length=pl.length,
            extent=extent,
            hint="serve with --tp-size 1",
        )
    return per


def _word_index(pl: Placement, per: int) -> np.ndarray:
    """Global word indices of the block's words, in the order of its C-order copy."""
    if pl.whole:
        return np.arange(-(-pl.n_elements // per), dtype=np.uint64)
    if pl.dim == 0:
        start = pl.src_start * pl.cols // per
        n = -(-pl.length * pl.cols // per)
        return np.arange(start, start + n, dtype=np.uint64)
    rows = np.arange(pl.rows, dtype=np.uint64)[:, None] * np.uint64(pl.cols // per)
    cols = np.arange(pl.length // per, dtype=np.uint64)[None, :] + np.uint64(pl.src_start // per)
    return (rows + cols).reshape(-1)


def aligned(pl: Placement, itemsize: int) -> bool:
    """Whether the block starts and ends on 8-byte words (:func:`partial_state` can sum it)."""
    try:
        _per(pl, itemsize)
    except EngineError:
        return False
    return True


def partial_state(pl: Placement, param: np.ndarray) -> Block:
    """This rank's block of ``pl``'s tensor as ``[dim, start, length, s0, s1]``: the
    rp.sum128 terms of the words it holds, at their indices in the whole tensor (natively:
    :func:`rollpatch.view.sum128_at`, one row per block row of a column split)."""
    block = extract(pl, param)
    per = _per(pl, block.itemsize)
    raw = np.ascontiguousarray(block).reshape(-1)
    pad = (-raw.size) % per
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, raw.dtype)])
    if pl.whole or pl.dim == 0:
        s0, s1 = sum128_at(raw, 0 if pl.whole else pl.src_start * pl.cols // per)
    else:
        s0, s1 = sum128_at(raw, pl.src_start // per, pl.length // per, pl.cols // per)
    return [pl.dim, pl.src_start, pl.length, s0, s1]


def word_map(pl: Placement, itemsize: int) -> tuple[int, int, int] | None:
    """Where the 8-byte words of this rank's parameter that hold ``pl``'s block sit among the
    whole tensor's words, as :func:`rollpatch.engines.sumchange.dry_change` takes it
    (``(j0, row_words, j_skip)``, word ``j`` of the parameter being the tensor's word
    ``j + j0 + (j // row_words) * j_skip``), or None where the block's words are not whole
    words of the tensor alone (a block edge inside a word, a tensor ending inside a word,
    whose last word the digest pads with zeros: :func:`partial_delta` sums those)."""
    per = 8 // itemsize
    width = pl.param_shape[1]
    if pl.sub is not None or per < 1 or pl.n_elements % per:
        return None
    if pl.dim == 0:
        shift = (pl.dst_start - pl.src_start) * pl.cols
        ends = (pl.src_start * pl.cols, (pl.src_start + pl.length) * pl.cols, shift)
        if width != pl.cols or any(e % per for e in ends):
            return None
        return -shift // per, 0, 0
    if any(x % per for x in (width, pl.cols, pl.src_start, pl.dst_start, pl.length)):
        return None
    return (pl.src_start - pl.dst_start) // per, width // per, (pl.cols - width) // per


def partial_delta(
    pl: Placement, param: np.ndarray, positions: np.ndarray, new: np.ndarray
) -> tuple[int, int]:
    """How this rank's sum changes when the held elements at checkpoint ``positions``
    (increasing, all held) become ``new``: reads only the 8-byte words they fall in."""
    if positions.size == 0:
        return 0, 0
    flat = param.reshape(-1)
    per = _per(pl, flat.itemsize)
    widx = positions // per
    first = np.r_[True, widx[1:] != widx[:-1]]
    u = widx[first]
    row = np.cumsum(first) - 1
    elems = (u[:, None] * per + np.arange(per)).reshape(-1)
    inside = elems < pl.n_elements  # the zero padding after the last element
    old_buf = np.zeros(elems.size, flat.dtype)
    held, offsets = locate(pl, elems[inside])
    if not bool(held.all()):
        raise EngineError("a changed word is not held by this rank", tensor=pl.name)
    old_buf[inside] = flat[offsets]
    old_buf = old_buf.reshape(u.size, per)
    new_buf = old_buf.copy()
    new_buf[row, positions % per] = new
    j = u.astype(np.uint64)
    (a0, a1) = sum128_terms(new_buf.view("<u8").reshape(-1), j)
    (b0, b1) = sum128_terms(old_buf.view("<u8").reshape(-1), j)
    return (a0 - b0) & _M64, (a1 - b1) & _M64


def combine(
    reports: Iterable[Mapping[str, Sequence[int]]], tensors: Mapping[str, Sequence[object]]
) -> tuple[dict[str, str], str]:
    """Every rank's blocks → per-tensor rp.sum128 digests and the root. ``tensors``: name →
    ``[kind, shape]`` (the engine's ``info``). Each distinct block counts once; the blocks
    of a tensor must tile it exactly (else :class:`EngineError`)."""
    blocks: dict[str, list[Sequence[int]]] = {n: [] for n in tensors}
    for report in reports:
        for name, b in report.items():
            if name not in blocks:
                raise EngineError("a rank reports a tensor the engine does not hold", tensor=name)
            blocks[name].append(b)
    digests: dict[str, str] = {}
    for name, (kind_name, shape) in tensors.items():
        kind = get_kind(str(kind_name))
        dims = tuple(int(d) for d in shape)  # type: ignore[attr-defined]
        state = combine_state(name, blocks[name], dims)
        nbytes = int(np.prod(dims, dtype=np.int64)) * kind.word_dtype.itemsize
        digests[name] = sum128_digest(kind.dtype, dims, nbytes, state)
    return digests, root_digest(digests)


def combine_state(
    name: str, blocks: Iterable[Sequence[int]], dims: tuple[int, ...]
) -> tuple[int, int]:
    """One tensor's rp.sum128 state from the ranks' blocks (``[dim, start, length, s0,
    s1]`` each, :func:`partial_state`): each distinct block once (a replica must carry the
    same sums), the blocks tiling the tensor exactly (else :class:`EngineError`)."""
    distinct: dict[tuple[int, int, int], tuple[int, int]] = {}
    for b in blocks:
        key, state = (int(b[0]), int(b[1]), int(b[2])), (int(b[3]), int(b[4]))
        if distinct.setdefault(key, state) != state:
            raise EngineError("two ranks hold one block with different words", tensor=name)
    rows = dims[0] if dims else 1
    cols = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    got = sorted(distinct.items())
    if len({k[0] for k, _ in got}) != 1:
        raise EngineError("ranks split a tensor along different axes", tensor=name)
    extent, at = (rows if got[0][0][0] == 0 else cols), 0
    for (_, start, length), _ in got:
        if length == 0:
            continue
        if start != at:
            raise EngineError("the ranks' blocks do not tile the tensor", tensor=name, at=at)
        at += length
    if at != extent:
        raise EngineError("the ranks' blocks do not cover the tensor", tensor=name)
    return sum(s[0] for _, s in got) & _M64, sum(s[1] for _, s in got) & _M64
