"""One rank's block of a checkpoint tensor in its vLLM runtime parameter, and the whole tensor
from every rank's block (numpy only; the placements themselves are :mod:`.layout`'s).

:func:`extract` reads a rank's block out of its parameter (a view), :func:`write_blocks` says
where a whole tensor's words go in it, :func:`block_shape` is the block's shape as every rank
knows it (what a receiver of a gathered block allocates), and :func:`assemble_blocks` joins
every rank's block into the checkpoint tensor, checking that replicas agree and that the
blocks cover it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...errors import EngineError
from .layout import Placement, blocks

__all__ = ["assemble", "assemble_blocks", "block_shape", "extract", "write_blocks"]


def extract(pl: Placement, param: np.ndarray) -> np.ndarray:
    """The block of ``param`` (2-D, this rank's) that holds checkpoint elements: a view.

    For an expert, the block of its slot (``blocks`` gives slot coordinates)."""
    whole = param.reshape(pl.param_shape)
    if pl.sub is None:
        return whole[blocks(pl)[1]]
    if pl.slot < 0:
        return whole[:0, :0].reshape(block_shape(pl))
    return whole[pl.slot].reshape(pl.sub)[blocks(pl)[1]]


def write_blocks(pl: Placement, data: np.ndarray) -> list[tuple[tuple[slice, slice], np.ndarray]]:
    """``[(parameter 2-D slices, block)]`` writing the tensor ``data`` (flat, whole) to the
    elements this rank holds, in ``param_shape`` coordinates (one block, or for an expert
    split by columns one per row of its slot)."""
    if not pl.length:
        return []
    src, dst = blocks(pl)
    block = data.reshape(pl.rows, pl.cols)[src]
    if pl.sub is None:
        return [(dst, block)]
    width = pl.sub[1]
    row = slice(pl.slot, pl.slot + 1)
    if pl.dim == 0 or pl.length == width:  # a contiguous run of the slot's row
        first = pl.dst_start * (width if pl.dim == 0 else 1)
        return [((row, slice(first, first + block.size)), block.reshape(1, -1))]
    return [
        (
            (row, slice(i * width + pl.dst_start, i * width + pl.dst_start + pl.length)),
            block[i : i + 1],
        )
        for i in range(pl.rows)
    ]


def block_shape(pl: Placement) -> tuple[int, int]:
    """The shape of :func:`extract`'s block, known to every rank."""
    length = 0 if pl.sub is not None and pl.slot < 0 else pl.length
    return (length, pl.cols) if pl.dim == 0 else (pl.rows, length)


def assemble(per_rank: Sequence[Placement], params: Sequence[np.ndarray]) -> np.ndarray:
    """The whole checkpoint tensor (flat) from every rank's placement and parameter."""
    return assemble_blocks(per_rank, [extract(pl, arr) for pl, arr in zip(per_rank, params)])


def assemble_blocks(per_rank: Sequence[Placement], held: Sequence[np.ndarray]) -> np.ndarray:
    """The whole checkpoint tensor (flat) from every rank's placement and block (what
    :func:`extract` gives).

    Ranks that hold the same elements (replicas) must agree; a disagreement means the engine
    holds inconsistent bits, which raises. Each rank's block is a range along one dimension,
    so overlaps and coverage are found on the ranges (no mask over the elements).
    """
    first = per_rank[0]
    out = np.empty((first.rows, first.cols), dtype=held[0].dtype)
    if any(pl.dim != first.dim for pl in per_rank):
        raise EngineError("ranks split the tensor along different dimensions", tensor=first.name)
    along = out if first.dim == 0 else out.T  # the split dimension first
    done: list[tuple[int, int]] = []
    for pl, block in zip(per_rank, held):
        lo, hi = pl.src_start, pl.src_start + pl.length
        blk = block if first.dim == 0 else block.T
        for a, b in done:  # replicated ranges: the copies must agree
            s, t = max(lo, a), min(hi, b)
            if s < t and not np.array_equal(along[s:t], blk[s - lo : t - lo]):
                raise EngineError("ranks disagree on a replicated block", tensor=pl.name)
        along[lo:hi] = blk
        done.append((lo, hi))
    reach = 0
    for a, b in sorted(done):
        if a > reach:
            break
        reach = max(reach, b)
    if reach < along.shape[0]:
        raise EngineError("ranks do not cover the tensor", tensor=first.name)
    return out.reshape(-1)
