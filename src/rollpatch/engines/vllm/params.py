"""A vLLM worker's torch parameters as the :class:`~.writes.Access` the core writes through.

:class:`TorchParams` is the worker glue's one object: it holds the model's parameters and, on
the CPU, numpy views that alias their memory (zero-copy reads, native checked writes); on
other devices, host copies for reading and torch ``index_put_`` for writing. It also owns what
the CPU backend's packed kernels need (docs/vllm.md, *The CPU prepack trap*): which modules'
kernels hold their own copy of the words (``_rollpatch_owns``, found by :mod:`.worker` at load
time), rebuilding them after writes, or building them while staging and swapping them in
under the pause (vLLM's CPU MoE kernel: the plain expert words kept by :mod:`.experts_cpu`
stand in for the packed parameters, and only the touched experts are re-packed); and the
double-buffered commit (``writes="double_buffer"``): each touched
parameter's new words staged in a second buffer and exchanged for the live one under the pause.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import EngineError
from ..writing import check_and_write, check_write, copy_with_writes
from . import experts_cpu
from .layout import storage_offsets
from .tpgather import TpGather
from .writes import Access

__all__ = ["TorchParams", "check_write"]

_WORDS = {2: (np.int16, np.uint16), 4: (np.int32, np.uint32)}


def _shape2(p: Any) -> tuple[int, int]:
    rows = int(p.shape[0]) if p.dim() else 1
    return rows, int(p.numel()) // max(rows, 1)


def _flat(a: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """The storage ``a`` spans, as one flat array of words, and its element strides."""
    elem = [s // a.itemsize for s in a.strides]
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, elem)) if a.size else 0
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,)), elem


def _aliases(model: Any) -> dict[str, str]:
    """Each module parameter's name → the name ``named_parameters`` lists the same tensor
    under, where they differ (tied weights: listed once, under the first name)."""
    listed = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for mod_name, mod in model.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            if listed.get(id(p), full) != full:
                out[full] = listed[id(p)]
    return out


class TorchParams:
    """One worker's parameters (see the module docstring); ``alias``: numpy views of the
    parameters' memory (the default on the CPU); False: host copies and torch writes (the
    GPU path, exercised on the CPU by tests)."""

    def __init__(self, model: Any, tp: int, *, alias: bool | None = None) -> None:
        import torch

        self._torch, self.model, self.tp = torch, model, tp
        self.params = dict(model.named_parameters())
        for name in list(self.params):  # CPU-packed experts: the plain copy is the view's
            mod, _, leaf = name.rpartition(".")
            plain = experts_cpu.plain_of(self._module(mod), leaf)
            if plain is not None:
                self.params[name] = plain
        #: A module parameter's name → the name the same tensor is listed under, where they
        #: differ (a tied LM head's ``lm_head.weight`` → ``model.embed_tokens.weight``): that
        #: module's kernel is rebuilt after writes to the tensor too.
        self.alias_of = _aliases(model)
        self.cpu = (
            all(p.device.type == "cpu" for p in self.params.values()) if alias is None else alias
        )
        self.views: dict[str, np.ndarray] = {}
        if self.cpu:
            for name in self.params:
                self._alias(name)
        # TP > 1: built on every rank at once (the worker's state is built in one
        # collective_rpc): it may make a process group, a collective
        self._tp = TpGather(tp, cpu=self.cpu) if tp > 1 else None

    # -- words -----------------------------------------------------------------------------

    def _words(self, p: Any) -> Any:
        return p.detach().view(getattr(self._torch, f"int{8 * p.element_size()}"))

    def _numpy(self, p: Any) -> np.ndarray:
        return self._words(p).numpy().view(_WORDS[p.element_size()][1])

    def _alias(self, name: str) -> None:
        p = self.params[name]
        a = self._numpy(p).reshape(_shape2(p))
        if a.size and a.__array_interface__["data"][0] != p.data_ptr():
            raise EngineError("parameter words do not alias the parameter", param=name)
        self.views[name] = a

    def read(self, name: str) -> np.ndarray:
        if self.cpu:
            return self.views[name]
        p = self.params[name]
        host = self._words(p).cpu().contiguous().numpy()
        return host.view(_WORDS[p.element_size()][1]).reshape(_shape2(p))

    def prepare(self, name: str, offsets: np.ndarray) -> np.ndarray:
        """CPU: storage offsets (stride-aware), computed before the pause."""
        if not self.cpu:
            return offsets
        return storage_offsets(offsets, self.views[name].shape, _flat(self.views[name])[1])

    def _device_index(self, p: Any, offsets: np.ndarray) -> tuple[Any, Any]:
        r, c = np.divmod(offsets, _shape2(p)[1])
        torch = self._torch
        return torch.from_numpy(r).to(p.device), torch.from_numpy(c).to(p.device)

    def scatter(self, name: str, prepared: np.ndarray, values: np.ndarray) -> None:
        p = self.params[name]
        if self.cpu:
            _flat(self.views[name])[0][prepared] = values
            return
        signed = values.view(_WORDS[p.element_size()][0])
        w = self._words(p).view(_shape2(p))  # a view (never a copy); indexing is stride-aware
        w.index_put_(
            self._device_index(p, prepared),
            self._torch.from_numpy(np.ascontiguousarray(signed)).to(p.device),
        )

    def read_at(self, name: str, prepared: np.ndarray) -> np.ndarray:
        from ...native import core as native

        p = self.params[name]
        if self.cpu:
            fl = _flat(self.views[name])[0]
            if native is None or fl.itemsize not in (2, 4):
                return fl[prepared]
            out = np.empty(prepared.size, fl.dtype)
            native.gather((8 * fl.itemsize, 2, 0, 0), fl, prepared, out)  # GIL released
            return out
        got = self._words(p).view(_shape2(p))[self._device_index(p, prepared)].cpu().numpy()
        return got.view(_WORDS[p.element_size()][1])

    def swap(self, name: str, prepared: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """CPU: check old, write new and read it back in one pass (all or nothing)."""
        check_and_write(_flat(self.views[name])[0], prepared, old, new, name, readback=True)

    def write(self, name: str, offsets: np.ndarray, values: np.ndarray) -> None:
        self.scatter(name, self.prepare(name, offsets), values)

    def write_block(self, name: str, index: tuple[slice, slice], block: np.ndarray) -> None:
        p = self.params[name]
        if self.cpu:
            self.views[name][index] = block
            return
        signed = np.ascontiguousarray(block).view(_WORDS[p.element_size()][0])
        self._words(p).view(_shape2(p))[index] = self._torch.from_numpy(signed).to(p.device)

    # -- derived buffers (the CPU packed kernels) --------------------------------------------

    def _module(self, name: str) -> Any:
        return self.model.get_submodule(name) if name else self.model

    def _holders(self, name: str) -> list[str]:
        """The modules holding parameter ``name``: its own, and those holding it under another
        name (:attr:`alias_of`)."""
        return [name.rpartition(".")[0]] + [
            a.rpartition(".")[0] for a, c in self.alias_of.items() if c == name
        ]

    def _owning(self, params: set[str] | dict[str, Any]) -> list[str]:
        """The modules holding ``params`` whose kernel holds its own copy of the words."""
        mods = sorted({m for p in params for m in self._holders(p)})
        return [m for m in mods if self._module(m).__dict__.get("_rollpatch_owns")]

    def repack(self, names: set[str]) -> None:
        """Rebuild the owning kernels of the modules of ``names`` from their parameters."""
        with self._torch.no_grad():
            for m in self._owning(names):
                mod = self._module(m)
                mod._rollpatch_repack(mod, remove_weight=False)

    def prebuild(
        self,
        writes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
        buffers: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Before the pause: each touched owning module's new kernel, built from its
        parameters with the staged words in (``buffers``: the double-buffered commit's new
        buffers; else a copy per module, old words checked, new ones read back), one module at
        a time. Modules whose kernel reads the live words need none.

        A kernel-only module's weight copy is made in one buffer per dtype, reused from module
        to module: its kernel was found at load to keep its own copy of the words and read
        the weight no more (:mod:`.worker`'s probe; the words written after the pause rely on
        the same), so the copy is free once the kernel is built. A fresh copy per module
        faulted in the model's size in new pages per stage: at the 441M model's 37 layers,
        copies of 414-431 ms p50 against 127-165 ms reused (one thread, alternated)."""
        torch, out = self._torch, {}
        scratch: dict[Any, Any] = {}  # dtype -> the reused buffer of kernel-only weights
        with torch.no_grad():
            for m in self._owning(writes):
                mod, shadow = self._module(m), types.SimpleNamespace()
                if experts_cpu.is_packed_experts(mod):  # the touched experts' packed slices
                    out[m] = experts_cpu.prebuild(mod, m, writes, buffers, check_write)
                    continue
                for attr in ("weight", "bias"):
                    p = getattr(mod, attr, None)
                    key = f"{m}.{attr}" if m else attr
                    key = self.alias_of.get(key, key)  # a tied head: the embedding's writes
                    if p is None:
                        setattr(shadow, attr, None)
                        continue
                    if buffers is not None and key in buffers:
                        copy = buffers[key]
                    elif attr == "weight" and mod.__dict__.get("_rollpatch_kernel_only"):
                        copy = self._written_copy(p, key, writes.get(key), scratch)
                    else:
                        copy = self._written_copy(p, key, writes.get(key))
                    setattr(shadow, attr, torch.nn.Parameter(copy, requires_grad=False))
                mod._rollpatch_repack(shadow, remove_weight=False)
                if hasattr(shadow, "cpu_linear"):  # else: re-packed inside the pause
                    out[m] = shadow.cpu_linear
        return out

    def install(self, prebuilt: dict[str, Any]) -> set[str]:
        """Under the pause: the prebuilt kernels swapped in (O(1) per module); packed expert
        slices copied in and read back. Each replaced kernel takes its new one's place in
        ``prebuilt``, so the caller frees them after the pause (freeing a model's packed
        weights takes milliseconds). On a failure every module already swapped is re-packed
        from its plain words (the caller restores those it wrote), then the error is raised."""
        done: list[str] = []
        try:
            for m, built in list(prebuilt.items()):
                if isinstance(built, experts_cpu.PackedExperts):
                    experts_cpu.install(self._module(m), m, built)
                else:
                    mod = self._module(m)
                    prebuilt[m], mod.cpu_linear = getattr(mod, "cpu_linear", None), built
                done.append(m)
        except BaseException:
            self.repack({f"{m}.weight" for m in done})
            raise
        return set(prebuilt)

    def kernel_only(self, name: str) -> bool:
        """Only kernels that keep their own copy read parameter ``name`` (every module holding
        it: a tied embedding's lookup reads it, even where the LM head's kernel does not)."""
        attr = name.rpartition(".")[2]
        for mod_name in self._holders(name):
            mod = self._module(mod_name)
            if not (attr == "weight" or experts_cpu.is_packed_experts(mod)) or not bool(
                mod.__dict__.get("_rollpatch_kernel_only")
            ):
                return False
        return True

    # -- the double-buffered commit ---------------------------------------------------------

    def buffer(self, name: str, prepared: np.ndarray, old: np.ndarray, new: np.ndarray) -> Any:
        """Before the pause: a copy of ``name`` (same strides) with the writes in, checked."""
        return self._written_copy(self.params[name], name, (prepared, old, new))

    def _written_copy(
        self,
        p: Any,
        name: str,
        writes: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
        scratch: dict[Any, Any] | None = None,
    ) -> Any:
        """A copy of ``p`` with the same strides (storage offsets carry over) and ``writes``
        (storage offsets, old words, new words) in: old words checked, new ones read back. A
        contiguous parameter is copied and written in one native pass (``copy_with_writes``),
        into ``scratch``'s buffer for its dtype when given (grown as needed; the copy is a
        view of it, valid until the next copy into it)."""
        torch, words = self._torch, self._numpy(p)
        if not words.flags.c_contiguous:  # a clone keeps the strides the offsets assume
            copy = p.detach().clone()
            if writes is not None:
                if tuple(copy.stride()) != tuple(p.stride()):
                    raise EngineError("a parameter's copy has other strides", param=name)
                check_write(_flat(self._numpy(copy).reshape(_shape2(p)))[0], *writes, name)
            return copy
        if scratch is None:
            copy = torch.empty_like(p, memory_format=torch.contiguous_format)
        else:
            buf = scratch.get(p.dtype)
            if buf is None or buf.numel() < p.numel():
                buf = scratch[p.dtype] = torch.empty(p.numel(), dtype=p.dtype)
            copy = buf[: p.numel()].view(p.shape)
        flat = self._numpy(copy).reshape(-1)
        if writes is None:
            np.copyto(flat, words.reshape(-1))
        else:
            copy_with_writes(words.reshape(-1), flat, *writes, name)
        return copy

    def exchange(self, buffers: dict[str, Any]) -> dict[str, Any]:
        """Under the pause: each parameter's storage exchanged for its buffer (O(1) each);
        returns the buffers it held (exchange them back to undo)."""
        held: dict[str, Any] = {}
        try:
            for name, t in buffers.items():
                p = self.params[name]
                held[name] = p.data
                p.data = t
                self._alias(name)
        except BaseException:
            self.exchange(held)
            raise
        return held

    # -- tensor parallelism ----------------------------------------------------------------

    def gather(self, name: str, local: np.ndarray) -> list[np.ndarray]:
        """Every rank's ``local`` block of ``name``, in rank order (:mod:`.tpgather`)."""
        assert self._tp is not None
        return self._tp.gather(local, self.params[name].device)

    def gather_to(
        self, name: str, local: np.ndarray, dst: int
    ) -> Callable[[], list[np.ndarray] | None]:
        """Every rank's ``local`` block of ``name`` on rank ``dst``, started now, finished by
        calling what it returns (:mod:`.tpgather`)."""
        assert self._tp is not None
        return self._tp.gather_to(local, self.params[name].device, dst)

    def share(self, data: bytes | None, src: int, size: int) -> memoryview:
        """Rank ``src``'s ``data`` on every rank, as ``size`` bytes (:mod:`.tpgather`)."""
        assert self._tp is not None
        return self._tp.share(data, next(iter(self.params.values())).device, src, size)

    def deliver(self, parts: list[bytes], sizes: list[int]) -> list[memoryview]:
        """Each rank's part to each rank, point to point (:mod:`.tpgather`)."""
        assert self._tp is not None
        return self._tp.deliver(parts, sizes)

    def delivers(self) -> bool:
        return self._tp is not None and self._tp.delivers

    def access(self) -> Access:
        cpu, one = self.cpu, self.tp == 1
        return Access(
            self.read,
            self.write,
            self.write_block,
            self.repack,
            self.gather if self.tp > 1 else None,
            aliases=cpu,
            prepare=self.prepare,
            scatter=self.scatter,
            read_at=self.read_at,
            prebuild=self.prebuild if cpu else None,
            install=self.install,
            swap=self.swap if cpu else None,
            kernel_only=self.kernel_only if cpu else None,
            buffer=self.buffer if cpu and one else None,
            exchange=self.exchange if cpu and one else None,
            own_collectives=self._tp.own if self._tp is not None and self._tp.background else None,
            gather_to=self.gather_to if self.tp > 1 else None,
            share=self.share if self.tp > 1 else None,
            deliver=self.deliver if self.tp > 1 else None,
            delivers=self.delivers if self.tp > 1 else None,
        )
