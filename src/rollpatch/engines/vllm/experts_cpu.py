"""vLLM's CPU MoE kernel: its prepacked experts kept patchable (docs/vllm.md, *The CPU prepack
trap*, and docs/moe.md).

vLLM's CPU backend (``CPUUnquantizedExperts`` and its x86/Arm/Power subclasses) re-lays
``w13_weight`` / ``w2_weight`` out for its grouped GEMM at load time
(``process_weights_after_loading`` → ``cpu_prepack_moe_weight``): same shape and dtype, another
order of the words. Checkpoint bits written there would serve garbage, and the packed words
cannot be hashed against a published view. So, as for dense layers, the worker keeps the
**plain** words (checkpoint layout) beside the packed parameter:

- :func:`keep_plain_experts` wraps the kernel's ``process_weights_after_loading`` (installed
  when vLLM imports the extension, before the model loads): it copies the plain words first,
  lets vLLM pack, and records the copy on the layer. The plain copy is what the view maps to:
  what is hashed, checked and written (:class:`~.params.TorchParams` substitutes it for the
  packed parameter). Nothing else reads it, so the layer is *kernel-only*: its plain words may
  be written after a commit's pause.
- Packing is vLLM's own ``cpu_prepack_moe_weight``, never re-implemented. It packs each expert
  independently (``prepack([E, N, K])`` is the concatenation of the per-expert prepacks: checked
  live by ``tests/test_moe_vllm_live.py``), so a patch re-packs only the experts it touches:
  :func:`prebuild` builds their packed slices from a copy of their plain words with the staged
  words written in (old words checked, new ones read back) while vLLM serves, and
  :func:`install` copies those slices into the live packed parameter under the pause and reads
  them back. :func:`repack_all` re-packs a whole layer (keyframe loads, failure paths).
- The packed words are what the kernel serves, so the background audit checks them too:
  :func:`audit_packed` re-packs a rotating slice of experts from their plain words and compares
  the result bitwise with the live packed slice, charged :data:`REPACK_COST` budget bytes per
  packed byte (re-packing costs that much more than hashing: docs/vllm.md).

Imports torch and vLLM only inside functions (this module is imported inside vLLM workers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import EngineError, TargetMismatchError

__all__ = [
    "LEAVES",
    "REPACK_COST",
    "PackedAudit",
    "PackedExperts",
    "PackedReport",
    "audit_packed",
    "check_packed",
    "flip_packed",
    "install",
    "is_packed_experts",
    "keep",
    "keep_plain_experts",
    "plain_of",
    "prebuild",
    "refusal",
    "repack_all",
]

#: The fused expert parameters the CPU kernel packs.
LEAVES = ("w13_weight", "w2_weight")
_PLAIN = "_rollpatch_plain"
_ISA = "_rollpatch_isa"
_REFUSED = "_rollpatch_experts_refused"
_WORDS = {2: np.uint16, 4: np.uint32}


def keep_plain_experts() -> None:
    """Wrap ``CPUUnquantizedExperts.process_weights_after_loading`` (all ISAs inherit it) so a
    plain copy of each layer's expert words is kept beside the packed parameters."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # GPU kernels read the plain parameters
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    original = cls.process_weights_after_loading
    if getattr(original, "_rollpatch", False):
        return

    def process(self: Any, layer: Any) -> None:
        import torch

        with torch.no_grad():
            plain = {
                leaf: getattr(layer, leaf).detach().clone(memory_format=torch.contiguous_format)
                for leaf in LEAVES
            }
        original(self, layer)
        if getattr(self, "_use_zentorch", False):
            return  # zentorch reads the plain parameters: nothing packed, nothing to keep
        shapes = {leaf: tuple(getattr(layer, leaf).shape) for leaf in LEAVES}
        if any(shapes[leaf] != tuple(plain[leaf].shape) for leaf in LEAVES):
            layer.__dict__[_REFUSED] = "the CPU kernel padded the intermediate size"
            return
        keep(layer, plain, str(self.isa))

    process._rollpatch = True  # type: ignore[attr-defined]
    cls.process_weights_after_loading = process


def keep(layer: Any, plain: dict[str, Any], isa: str) -> None:
    """Record ``plain`` (leaf → plain words) as ``layer``'s view and ``isa`` for re-packing,
    with the flags the dense prepack trap uses (see :mod:`.worker` and :mod:`.params`): the
    kernel owns its words, and only rollpatch reads the plain copy (kernel-only). A layer
    processed again (a reload that re-packs) keeps its plain tensors, refreshed in place: the
    worker's parameter access holds them."""
    held = layer.__dict__.get(_PLAIN)
    if held is not None and all(held[k].shape == v.shape for k, v in plain.items()):
        for k, v in plain.items():
            held[k].copy_(v)
        plain = held
    layer.__dict__[_PLAIN] = plain
    layer.__dict__[_ISA] = isa
    layer.__dict__["_rollpatch_repack"] = repack_all
    layer.__dict__["_rollpatch_owns"] = True
    layer.__dict__["_rollpatch_kernel_only"] = True


def is_packed_experts(mod: Any) -> bool:
    """True for a layer whose experts the CPU kernel packed and whose plain words are kept."""
    return _PLAIN in mod.__dict__


def plain_of(mod: Any, leaf: str) -> Any | None:
    """The plain (checkpoint-layout) words of ``mod.<leaf>``, or None when not packed."""
    plain = mod.__dict__.get(_PLAIN)
    return None if plain is None else plain.get(leaf)


def refusal(mod: Any) -> str:
    """Why a CPU-packed expert layer has no plain copy (for describe's error)."""
    return str(
        mod.__dict__.get(
            _REFUSED,
            "vLLM's CPU MoE kernel packed the expert weights and no plain copy was kept "
            "(load the extension with --worker-extension-cls before the model loads)",
        )
    )


def _prepack(weight: Any, isa: str) -> Any:
    from vllm._custom_ops import cpu_prepack_moe_weight

    return cpu_prepack_moe_weight(weight.contiguous(), isa)


def repack_all(mod: Any, remove_weight: bool = False) -> None:
    """Re-pack every expert of ``mod`` from its plain words into the live packed parameters
    (in place: the parameters keep their storage). ``remove_weight`` is ignored (the signature
    of the dense layers' re-pack hook)."""
    import torch

    with torch.no_grad():
        for leaf in LEAVES:
            getattr(mod, leaf).data.copy_(_prepack(mod.__dict__[_PLAIN][leaf], mod.__dict__[_ISA]))


@dataclass
class PackedExperts:
    """A layer's touched experts, packed while staging: per leaf, the expert indices (int64
    tensor) and their packed words ``[k, N, K]``, to be copied into the live parameter."""

    slices: dict[str, tuple[Any, Any]]


def _numpy_flat(t: Any) -> np.ndarray:
    import torch

    words = t.view(getattr(torch, f"int{8 * t.element_size()}"))
    return words.numpy().view(_WORDS[t.element_size()]).reshape(-1)


def prebuild(
    mod: Any,
    module: str,
    writes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    buffers: dict[str, Any] | None,
    check: Any,
) -> PackedExperts:
    """Before the pause: for each leaf of ``mod`` written by ``writes`` (``{param: (prepared
    storage offsets into the plain words, old, new)}``), the touched experts' packed slices,
    built from a copy of their plain words with the writes in (``check(flat, local, old, new,
    name)`` checks the old words and reads the new ones back), or from ``buffers[param]``
    (the double-buffered commit's new plain words, already checked)."""
    import torch

    slices: dict[str, tuple[Any, Any]] = {}
    with torch.no_grad():
        for leaf in LEAVES:
            key = f"{module}.{leaf}" if module else leaf
            if key not in writes:
                continue
            plain = mod.__dict__[_PLAIN][leaf]
            per = int(plain[0].numel())
            prepared, old, new = writes[key]
            owner = prepared // per
            experts = np.unique(owner)
            idx = torch.from_numpy(experts.astype(np.int64))
            if buffers is not None and key in buffers:
                sub = buffers[key].index_select(0, idx)
            else:
                sub = plain.index_select(0, idx)  # a contiguous copy of the touched experts
                local = np.searchsorted(experts, owner) * per + prepared % per
                check(_numpy_flat(sub), local, old, new, key)
            slices[leaf] = (idx, _prepack(sub, mod.__dict__[_ISA]))
    return PackedExperts(slices)


def _same_bits(a: Any, b: Any) -> bool:
    """Bitwise equality (as integer words: exact for NaN payloads and ±0, and far faster than
    comparing BF16 values on the CPU)."""
    import torch

    words = getattr(torch, f"int{8 * a.element_size()}")
    return bool(torch.equal(a.view(words), b.view(words)))


def _runs(experts: np.ndarray) -> list[tuple[int, int, int]]:
    """Sorted expert indices as runs ``(first, end, offset in the slices)``."""
    if experts.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(experts) != 1) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [experts.size]])
    return [(int(experts[i]), int(experts[j - 1]) + 1, int(i)) for i, j in zip(starts, ends)]


def install(mod: Any, module: str, packed: PackedExperts) -> None:
    """Under the pause: the prebuilt slices copied into the live packed parameters and read
    back. On any failure the layer is re-packed whole from its plain words (not yet written:
    they are kernel-only, written after the pause), so it keeps serving the old version."""
    import torch

    try:
        with torch.no_grad():
            for leaf, (idx, sl) in packed.slices.items():
                live = getattr(mod, leaf).data
                for a, b, at in _runs(idx.numpy()):  # contiguous experts: one memcpy each
                    live[a:b].copy_(sl[at : at + b - a])
                    if not _same_bits(live[a:b], sl[at : at + b - a]):  # read back
                        raise TargetMismatchError(
                            "read-back of packed experts differs", param=f"{module}.{leaf}"
                        )
    except BaseException:
        repack_all(mod)
        raise


def check_packed(model: Any) -> dict[str, Any]:
    """Re-pack every kept plain expert layer with vLLM's own prepack, whole and expert by
    expert, and compare with the live packed parameters (tests and drills; O(experts))."""
    import torch

    layers = experts = relaid = 0
    bad: list[str] = []
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not is_packed_experts(mod):
                continue
            layers += 1
            isa = mod.__dict__[_ISA]
            for leaf in LEAVES:
                plain, live = mod.__dict__[_PLAIN][leaf], getattr(mod, leaf).data
                whole = _prepack(plain, isa)
                per = torch.cat([_prepack(plain[e : e + 1], isa) for e in range(plain.shape[0])])
                experts += int(plain.shape[0])
                if not _same_bits(whole, live) or not _same_bits(per, live):
                    bad.append(f"{name}.{leaf}")
                relaid += int(not _same_bits(plain, live))  # the packing moved words
    if not layers:
        raise EngineError("no CPU-packed expert layers in this model")
    return {"layers": layers, "experts": experts, "mismatched": bad, "relaid": relaid}


#: Audit budget bytes charged per packed byte re-packed and compared. Measured on the 2-core
#: development machine (AMD EPYC, AVX2: ``isa`` ``vec``; ``amx`` packed as fast), best of 20,
#: vLLM 0.32's ``cpu_prepack_moe_weight`` + an integer ``torch.equal`` against rollpatch's
#: native rp.sum128 of the same words: 8-10x for 16-32 KiB experts, 20x for a 3 MiB expert,
#: 33x for a 6 MiB one (a 1536 x 2048 w13, Qwen3-30B-A3B-sized). The worst ratio is charged.
REPACK_COST = 32


@dataclass
class PackedAudit:
    """The packed audit's round-robin state: the expert slices ``(param, module, leaf,
    expert, packed bytes)`` in a fixed order (found once), the next one, and the budget carried
    from calls whose share was smaller than one slice's cost."""

    units: list[tuple[str, Any, str, int, int]]
    next: int = 0
    credit: float = 0.0
    #: The bytes of the whole view the hash audit covers (set by the worker).
    view_bytes: int = 0

    @classmethod
    def of(cls, model: Any) -> PackedAudit:
        units: list[tuple[str, Any, str, int, int]] = []
        for name, mod in sorted(model.named_modules(), key=lambda nm: nm[0]):
            if not is_packed_experts(mod):
                continue
            for leaf in LEAVES:
                plain = mod.__dict__[_PLAIN][leaf]
                per = int(plain[0].numel()) * plain.element_size()
                key = f"{name}.{leaf}" if name else leaf
                units.extend((key, mod, leaf, e, per) for e in range(int(plain.shape[0])))
        return cls(units)

    @property
    def nbytes(self) -> int:
        """The packed bytes one full round re-packs."""
        return sum(u[4] for u in self.units)

    def share(self, budget: int) -> int:
        """The part of an audit call's ``budget`` that re-packs: in proportion to the cost of
        a full round of each, so hashing the view and re-packing every expert finish their
        rounds after the same number of calls."""
        cost = REPACK_COST * self.nbytes
        return budget * cost // (self.view_bytes + cost) if cost else 0


@dataclass(frozen=True)
class PackedReport:
    """One packed audit slice: expert slices re-packed and compared, their packed bytes, the
    budget charged for them, the parameters whose live packed words differ (``name[expert]``),
    whether the round wrapped, and the time it took."""

    experts: int
    nbytes: int
    charged: int
    mismatched: tuple[str, ...]
    wrapped: bool
    ms: float


def audit_packed(state: PackedAudit, budget: int) -> PackedReport:
    """Re-pack the next expert slices from their plain words with vLLM's prepack and compare
    each bitwise with the live packed slice, while ``budget`` (plus the credit carried over)
    pays :data:`REPACK_COST` per packed byte. The credit is capped at one call's budget or one
    slice's cost, whichever is larger, so a call never bursts past that. The caller keeps it
    away from commits (no audit while words are still being written after a pause)."""
    import time

    import torch

    if not state.units:
        return PackedReport(0, 0, 0, (), False, 0.0)
    t0 = time.perf_counter()
    biggest = max(u[4] for u in state.units) * REPACK_COST
    state.credit = min(state.credit + budget, max(budget, biggest))
    done = nbytes = 0
    wrapped = False
    bad: list[str] = []
    with torch.no_grad():
        while done < len(state.units):
            key, mod, leaf, e, per = state.units[state.next]
            if per * REPACK_COST > state.credit:
                break
            state.credit -= per * REPACK_COST
            plain = mod.__dict__[_PLAIN][leaf][e : e + 1]
            if not _same_bits(
                _prepack(plain, mod.__dict__[_ISA]), getattr(mod, leaf).data[e : e + 1]
            ):
                bad.append(f"{key}[{e}]")
            done, nbytes = done + 1, nbytes + per
            state.next = (state.next + 1) % len(state.units)
            wrapped = wrapped or state.next == 0
    ms = (time.perf_counter() - t0) * 1e3
    return PackedReport(done, nbytes, nbytes * REPACK_COST, tuple(bad), wrapped, ms)


def flip_packed(model: Any, param: str, position: int) -> int:
    """Fault injection (the caller checks it is enabled): flip the lowest bit of the word at
    flat ``position`` of the live PACKED parameter ``param`` (``<layer>.w13_weight`` or
    ``<layer>.w2_weight``), behind the plain words and every digest. Returns 1."""
    import torch

    mod_name, _, leaf = param.rpartition(".")
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        mod = None
    if mod is None or leaf not in LEAVES or not is_packed_experts(mod):
        raise EngineError("not a CPU-packed expert parameter", param=param)
    live = getattr(mod, leaf).data
    if not 0 <= position < live.numel():
        raise EngineError("position out of range", param=param, size=int(live.numel()))
    with torch.no_grad():
        words = live.view(getattr(torch, f"int{8 * live.element_size()}")).reshape(-1)
        words[position] ^= 1
    return 1
