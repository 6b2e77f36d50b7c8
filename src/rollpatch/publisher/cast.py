"""The publisher's BF16 cast: native on the host (one pass that also finds the step's changes),
torch on a device; the bits are formats' on every path.

**Host, native** (:func:`snapshot_native`, the CPU fast path). One pass of the native core
(``rp_cast.c``) per range of a master: each float32 is rounded to BF16 in registers (round to
nearest, ties to even, on the bits; every NaN becomes 0xFFFF, ``formats.floats.BF16_NAN``),
stored once into the snapshot's reused words (:class:`~rollpatch.publisher.wordpool.WordPool`)
and, while still in a register, compared with the previous snapshot's word; the positions and
the old and new words that differ are listed. Those are the step's changes that a publisher
composing skip patches needs (``ShardPipeline``'s accumulators): with them the encoder runs its
plain pass (``encode_views``) instead of the one that also hands the changes over
(``encode_views_patch``), which measured about twice its CPU time. They are valid only against
the view they were compared with (:class:`StepChanges` names it); the pipeline uses them only
when that view is its base, and checks their counts against the encoder's.

**Torch** (:func:`bf16_words`: the device path, and the host when the native core is missing).
torch's vectorised ``copy_`` casts; the NaN check reads the BF16 result while it is in cache:

- A float32 value is NaN exactly when its BF16 cast is NaN: torch maps every NaN to a NaN
  (x86 vector kernels 0xFFFF, scalar 0x7FC0, CUDA 0x7FFF; only NaN-ness is portable), and
  rounding a non-NaN value never yields a NaN (the largest finite values round to ±inf,
  0x7F80/0xFF80). So checking the result finds the same elements as checking the master.
- Every NaN then becomes 0xFFFF, so the bits are those of :func:`rollpatch.formats.cast_view`.

BF16 keeps ±inf, so ``bf16`` refuses nothing; quantised tensors are not cast here (their
formats refuse NaN/inf with ``FormatError``, and ``snapshot_served`` leaves them to
``formats``). torch is imported only by the functions that take torch tensors: a numpy caller
never pays for it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import native
from ..errors import BoardError
from ..formats import cast_view, get_format
from ..io.checkpoint import to_numpy
from ..kinds import KINDS
from ..patch import DeltaOp, Patch, TensorPatch
from ..patch.header import PatchHeader
from ..view import Tensor, View

if TYPE_CHECKING:
    import torch

    from .config import PublisherConfig
    from .wordpool import WordPool

__all__ = [
    "CAST_CHUNK",
    "CastView",
    "HostSnapshots",
    "StepChanges",
    "bf16_words",
    "castable",
    "has_step",
    "host_words",
    "snapshot_native",
    "step_patch",
]

#: Elements cast per step on the CPU: 2 MiB of BF16 result, re-read from cache by the check.
CAST_CHUNK = 1 << 20
#: BF16 word of every NaN (``formats.floats.BF16_NAN``, 0xFFFF, as int16).
_BF16_NAN = -1
#: Elements per job of the native pass (tensors are cut into ranges for the threads).
_RANGE = 1 << 22
#: Changes listed per element of a range at most (beyond it the step is left to the encoder:
#: a step that dense is coded as XOR+zstd anyway, and the lists would cost more than words).
_MAX_CHANGED = 1 / 16
#: Master elements from which the native pass runs on several threads.
_THREADED_MIN = 1 << 20


def bf16_words(master: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flat BF16 words (int16) of a float32/bfloat16/float16 tensor, as ``formats`` casts, on
    the tensor's device; never shares memory with a float master.

    A BF16 master keeps every bit (NaN payloads too, a view of its words); a float master is
    read once (the cast), and the NaN check reads the result (see the module docstring).
    ``out``: a flat CPU bfloat16 tensor of the master's size that a float32 master on the CPU
    is cast into (memory already paged in, :class:`~rollpatch.publisher.wordpool.WordPool`);
    ignored otherwise.
    """
    import torch

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
    in full and returned. The native core's pass when it is built, else torch's cast."""
    if not castable(master):
        raise TypeError("host_words casts non-empty, writable, C-contiguous float32 arrays")
    if out is not None and (
        out.dtype != np.uint16
        or out.shape != (master.size,)
        or not out.flags.c_contiguous
        or not out.flags.writeable
        or np.shares_memory(out, master)
    ):
        raise ValueError("out must be a writable, flat uint16 array of the master's size")
    flat = master.reshape(-1)
    native_cast = getattr(native.core, "cast_bf16", None)  # None: no core, or one built before it
    if native_cast is not None:
        words = np.empty(flat.size, np.uint16) if out is None else out
        native_cast(flat, words)
        return words
    import torch

    if out is None:
        return bf16_words(torch.from_numpy(flat)).numpy().view(np.uint16)
    bf16_words(torch.from_numpy(flat), torch.from_numpy(out.view(np.int16)).view(torch.bfloat16))
    return out


# -- the native snapshot ---------------------------------------------------------------------


@dataclass
class StepChanges:
    """The changes the snapshot's cast found against the previous snapshot's view ``base``
    (held weakly: the changes never keep a view alive), tensor by tensor: positions (int64,
    increasing) and the old and new words (uint16). Every tensor of the snapshot is listed
    (empty arrays where nothing changed)."""

    base: weakref.ref[View]
    tensors: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]


class CastView(View):
    """A snapshot's served view with the changes its cast found (``step``; None: not
    compared). :func:`step_patch` takes them, once."""

    step: StepChanges | None = None


def snapshot_native(
    state_dict: Mapping[str, Any],
    config: PublisherConfig,
    pool: WordPool,
    previous: View | None = None,
) -> CastView | None:
    """The served BF16 view of ``state_dict`` in the native pass (module docstring), its
    words in ``pool``'s buffers; with ``previous`` (the last snapshot's view), the changes
    against it in ``step`` when every tensor could be compared (same names and shapes, none
    too dense). None when this path does not apply (no native core, a format other than
    plain BF16, a master that is not a float32 CPU tensor): ``snapshot_served`` then casts."""
    core = native.core
    if core is None or not hasattr(core, "cast_bf16_diff"):
        return None
    fmt = get_format(config.format)
    if fmt.plain_kind != "bf16" or config.scales == "frozen" or not state_dict:
        return None
    masters: dict[str, np.ndarray] = {}
    for name, value in state_dict.items():
        if (
            not isinstance(name, str)
            or getattr(getattr(value, "device", None), "type", "cpu") != "cpu"
        ):
            return None
        arr = to_numpy(value)
        if (
            arr.dtype != np.float32
            or arr.size == 0
            or fmt.quantises(name, arr.shape, config.policy)
        ):
            return None
        masters[name] = np.ascontiguousarray(arr).reshape(-1)
    bf16 = KINDS["bf16"]
    words = {name: pool.take(name, m.size) for name, m in masters.items()}
    prev = {}
    if previous is not None:
        prev = {
            n: previous[n].data.reshape(-1)
            for n, m in masters.items()
            if n in previous
            and previous[n].kind == bf16
            and previous[n].shape == tuple(state_dict[n].shape)
            and not np.shares_memory(previous[n].data, words[n])
        }
    jobs = [
        (name, s, min(s + _RANGE, m.size))
        for name, m in masters.items()
        for s in range(0, m.size, _RANGE)
    ]

    def one(job: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        name, s, e = job
        src, dst = masters[name][s:e], words[name][s:e]
        base = prev.get(name)
        if base is None:
            core.cast_bf16(src, dst)
            return None
        cap = int((e - s) * _MAX_CHANGED) + 16
        pos, old, new = np.empty(cap, np.int64), np.empty(cap, np.uint16), np.empty(cap, np.uint16)
        k, _ = core.cast_bf16_diff(src, base[s:e], dst, pos, old, new)
        if k > cap:
            return None
        pos = pos[:k]
        pos += s
        return pos, old[:k], new[:k]

    total = sum(m.size for m in masters.values())
    found = native.parallel_map(one, jobs) if total >= _THREADED_MIN else [one(j) for j in jobs]
    meta = dict(cast_view({}, fmt, scales=config.scales).metadata)
    view = CastView(
        {n: Tensor(bf16, tuple(state_dict[n].shape), w) for n, w in words.items()}, meta
    )
    if previous is not None and len(prev) == len(masters) and all(f is not None for f in found):
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {n: [] for n in masters}
        for (name, _, _), f in zip(jobs, found, strict=True):
            assert f is not None
            parts[name].append(f)
        view.step = StepChanges(weakref.ref(previous), {n: _joined(p) for n, p in parts.items()})
    return view


def _joined(
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One tensor's (positions, old, new) from its ranges' lists, in order."""
    if len(parts) == 1:
        return parts[0]
    pos, old, new = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return pos, old, new


def has_step(view: View, prev: View) -> bool:
    """Whether ``view``'s cast listed its changes against ``prev`` itself (same tensors):
    then :func:`step_patch` gives the step patch and the encoder need not hand it over."""
    step = view.step if isinstance(view, CastView) else None
    return step is not None and step.base() is prev and set(step.tensors) == set(prev)


class HostSnapshots:
    """One publisher's host snapshots of the served view: the words in ``pool`` (reused once
    free), cast by :func:`snapshot_native` (compared with the last snapshot when ``compare``)
    or else by ``snapshot.snapshot_served``; one snapshot at a time."""

    def __init__(self, pool: WordPool) -> None:
        self.pool = pool
        self._last: View | None = None
        self._lock = threading.Lock()

    def take(
        self, state_dict: Mapping[str, Any], config: PublisherConfig, *, compare: bool
    ) -> View:
        from .snapshot import snapshot_served  # it imports us: imported when first used

        with self._lock:
            last = self._last if compare else None
            view: View | None = snapshot_native(state_dict, config, self.pool, last)
            if view is None:
                view = snapshot_served(state_dict, config, self.pool)
            self._last = view if compare else None
        return view


def step_patch(prev: View, view: View, header: PatchHeader, meta: Mapping[str, str]) -> Patch:
    """``diff(prev, view)`` from the changes ``view``'s cast listed (:func:`has_step` must
    hold), which the view then forgets.

    ``header``: the step's encoded patch, whose per-tensor counts the lists must match (the
    encoder compared every word too): anything else is an internal error. Call it after the
    encoder, which left ``view``'s digests known from ``prev``'s in O(change).
    """
    step = view.step if isinstance(view, CastView) else None
    if step is None or not isinstance(view, CastView) or not has_step(view, prev):
        raise BoardError("the snapshot's cast has no changes against this base (internal error)")
    view.step = None
    coded = {e["name"]: int(e["changed"]) for e in header.tensors if e["op"] == "delta"}
    listed = {n: int(p.size) for n, (p, _, _) in step.tensors.items() if p.size}
    if coded != listed or len(coded) != len(header.tensors):
        raise BoardError(
            "the snapshot's cast found other changes than the encoder (internal error)",
            encoder=sum(coded.values()),
            cast=sum(listed.values()),
        )
    tensors = {
        name: TensorPatch(
            name,
            view[name].kind,
            view[name].shape,
            prev.tensor_digest(name),
            view.tensor_digest(name),
            DeltaOp(pos, old, new),
        )
        for name, (pos, old, new) in sorted(step.tensors.items())
        if pos.size
    }
    return Patch(prev.digest(), view.digest(), tensors, meta=dict(meta))
