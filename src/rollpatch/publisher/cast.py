"""The publisher's BF16 cast in torch: one pass over the master, the NaN check on the result.

``formats`` casts in numpy (``formats.floats.f32_to_bf16_bits``: several passes over each
chunk plus a ``max`` of the FP32 chunk to find NaN). Here the cast is torch's vectorised
``copy_`` (round to nearest, ties to even, on every device) and the NaN check reads the BF16
result, half the bytes of the master, while it is still in cache:

- A float32 value is NaN exactly when its BF16 cast is NaN: torch maps every NaN to a NaN
  (x86 vector kernels 0xFFFF, scalar 0x7FC0, CUDA 0x7FFF; only NaN-ness is portable), and
  rounding a non-NaN value never yields a NaN (the largest finite values round to ±inf,
  0x7F80/0xFF80). So checking the result finds the same elements as checking the master.
- Every NaN then becomes 0xFFFF, the word ``formats`` pins (``formats.floats.BF16_NAN``), so
  the bits are those of :func:`rollpatch.formats.cast_view` on every device.

BF16 keeps ±inf, so ``bf16`` refuses nothing; quantised tensors are not cast here (their
formats refuse NaN/inf with ``FormatError``, and ``snapshot_served`` leaves them to
``formats``). :func:`host_words` is what the host snapshot uses when the trainer's process
has imported torch (every trainer has; the publisher never imports it for a numpy caller).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["CAST_CHUNK", "bf16_words", "castable", "host_words"]

#: Elements cast per step on the CPU: 2 MiB of BF16 result, re-read from cache by the check.
CAST_CHUNK = 1 << 20
#: BF16 word of every NaN (``formats.floats.BF16_NAN``, 0xFFFF, as int16).
_BF16_NAN = -1


def bf16_words(master: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat BF16 words (int16) of a float32/bfloat16/float16 tensor, as ``formats`` casts, on
    the tensor's device; never shares memory with a float master.

    A BF16 master keeps every bit (NaN payloads too, a view of its words); a float master is
    read once (the cast), and the NaN check reads the result (see the module docstring).
    ``out``: a flat CPU bfloat16 tensor of the master's size that a float32 master on the CPU
    is cast into (memory already paged in, :class:`~rollpatch.publisher.wordpool.WordPool`);
    ignored otherwise.
    """
    m = master.detach().reshape(-1)
    if m.dtype == torch.bfloat16:
        return m.view(torch.int16)
    if m.dtype == torch.float16:
        m = m.to(torch.float32)
    if m.dtype != torch.float32:
        raise TypeError(f"cannot cast a {m.dtype} master to BF16")
    if m.device.type != "cpu":  # one kernel each, no host sync
        out = m.to(torch.bfloat16)
        return out.view(torch.int16).masked_fill_(torch.isnan(out), _BF16_NAN)
    if out is None or out.dtype != torch.bfloat16 or out.shape != (m.numel(),):
        out = torch.empty(m.numel(), dtype=torch.bfloat16)
    for start in range(0, m.numel(), CAST_CHUNK):
        dst = out[start : start + CAST_CHUNK]
        dst.copy_(m[start : start + CAST_CHUNK])
        if bool(torch.isnan(dst.max())):  # max propagates NaN; dst is still in cache
            dst.view(torch.int16).masked_fill_(torch.isnan(dst), _BF16_NAN)
    return out.view(torch.int16)


def castable(master: np.ndarray) -> bool:
    """Whether :func:`host_words` takes ``master``: a non-empty, writable (torch reads numpy
    memory only through writable arrays), C-contiguous, native float32 array."""
    return (
        master.dtype == np.float32
        and master.dtype.isnative
        and master.flags.c_contiguous
        and master.flags.writeable
        and master.size > 0
    )


def host_words(master: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """BF16 words (flat uint16) of a :func:`castable` numpy array, bit for bit
    ``formats.floats.f32_to_bf16_bits``; a new array (the master may change afterwards), or
    ``out`` (flat, C-contiguous uint16 of the master's size, not sharing its memory) written
    in full and returned."""
    if not castable(master):
        raise TypeError("host_words casts non-empty, writable, C-contiguous float32 arrays")
    flat = torch.from_numpy(master.reshape(-1))
    if out is None:
        return bf16_words(flat).numpy().view(np.uint16)
    if (
        out.dtype != np.uint16
        or out.shape != (master.size,)
        or not out.flags.c_contiguous
        or not out.flags.writeable
        or np.shares_memory(out, master)
    ):
        raise ValueError("out must be a writable, flat uint16 array of the master's size")
    bf16_words(flat, torch.from_numpy(out.view(np.int16)).view(torch.bfloat16))
    return out
