"""What a commit leaves out of its pause (issue 10), offline: the vLLM worker's staging memory
trace and its staging thread's cores, the kernels a commit replaces freed after the pause,
the built-in engine's double-buffered storage made ready while staging, the shared
writer pool restoring every parameter when one write fails, and its check-and-write."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.vllm.layout import ParamSpec, Shard
from rollpatch.engines.vllm.memtrace import MemTrace, rss_bytes, trim
from rollpatch.engines.vllm.ops import widen_cores
from rollpatch.engines.vllm.weights import RuntimeWeights
from rollpatch.engines.writing import ParamWrites, check_and_write, numpy_access, write_params
from rollpatch.errors import BaseMismatchError
from rollpatch.kinds import get_kind
from rollpatch.patch import diff
from tests import vllm_layouts

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and affinity")


@linux
def test_memtrace_attributes_a_phase_peak() -> None:
    """A phase that holds 64 MiB at its peak reports about that; a later phase that holds
    nothing new reports less; ``held`` is what stays at the end. In a full CI run the phase
    once read 54 MiB: memory of earlier tests freed while it ran (the cyclic collector can
    run on any allocation) offsets it in the process's resident set. So earlier garbage is
    collected and the heap trimmed first, and the collector is held off meanwhile."""
    gc.collect()
    trim()
    gc.disable()
    try:
        with MemTrace() as mem:
            mem.mark("nothing")
            big = np.ones(64 << 20, np.uint8)  # touched: resident
            mem.mark("big")
            del big
            trim()
            mem.mark("after")
    finally:
        gc.enable()
    rep = mem.report()
    assert rss_bytes() > 0 and rep["start_mib"] > 0
    assert rep["big_mib"] >= 60 and rep["nothing_mib"] < 32 and rep["peak_mib"] >= 60
    assert set(rep) == {"nothing_mib", "big_mib", "after_mib", "peak_mib", "held_mib", "start_mib"}
    assert trim() >= 0.0


@linux
def test_staging_thread_widens_to_every_core_only_itself() -> None:
    """The staging thread of a worker pinned to one core (vLLM's OpenMP binding) may run on
    every core; the thread that started it keeps its own cores."""
    before = os.sched_getaffinity(0)
    got: list[tuple[int, set[int]]] = []

    def staging() -> None:
        os.sched_setaffinity(0, {min(before)})  # as vLLM's worker threads are
        n = widen_cores()
        got.append((n, os.sched_getaffinity(0)))

    t = threading.Thread(target=staging)
    t.start()
    t.join()
    ((n, mask),) = got
    assert n == len(mask) and mask >= before
    assert os.sched_getaffinity(0) == before


def test_replaced_kernels_are_freed_after_the_pause() -> None:
    """A staged commit swaps in the kernels built while staging; the kernels it replaced go
    to the writer thread that runs after the pause (freeing a model's packed weights is not
    pause work), and are gone once it is done."""
    torch = pytest.importorskip("torch")
    from rollpatch.engines.vllm.params import TorchParams

    class Kernel:
        def __init__(self, words: Any) -> None:
            self.words = words

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(6, 4).to(torch.bfloat16).requires_grad_(False)

    def repack(mod: Any, remove_weight: bool) -> None:
        mod.cpu_linear = Kernel(mod.weight.detach().view(torch.int16).clone())

    model.lin._rollpatch_repack = repack
    model.lin._rollpatch_owns = True
    repack(model.lin, False)
    specs = [
        ParamSpec(n, "replicated", (Shard(n, tuple(p.shape)),)) for n, p in model.named_parameters()
    ]
    w = RuntimeWeights(
        specs, {s.param: get_kind("bf16") for s in specs}, TorchParams(model, 1).access()
    )

    def words(p: Any) -> np.ndarray:
        return p.detach().view(torch.int16).numpy().view(np.uint16).copy()

    v0 = vllm_layouts.words_view({n: words(p) for n, p in model.named_parameters()})
    v1 = vllm_layouts.words_view({n: words(p) for n, p in model.named_parameters()})
    for n in v1:
        v1[n].data[::2] ^= 0x0101
        v1.invalidate(n)
    old = weakref.ref(model.lin.cpu_linear)
    staged = w.stage(diff(v0, v1))
    built = staged.payload["prebuilt"]["lin"]
    w.commit_staged(staged)
    assert model.lin.cpu_linear is built
    w.settler.wait()
    del staged
    gc.collect()
    assert old() is None
    assert w.digests(fresh=True) == v1.tensor_digests()


def test_writer_pool_restores_every_parameter_when_one_fails() -> None:
    """The writes run on a pool kept for the process: when one parameter's old words do not
    match, every task still ends before the rollback, which writes the held version's words
    over every staged position of the parameters started (the mismatching word included)."""
    rng = np.random.default_rng(0)
    params = {f"p{i}": rng.integers(0, 1 << 16, 50_000, dtype=np.uint16) for i in range(6)}
    before = {n: a.copy() for n, a in params.items()}
    writes = {}
    for n, a in params.items():
        pos = np.arange(0, a.size, 7, dtype=np.int64)
        old = a[pos].copy()
        if n == "p3":
            old[-1] ^= 1  # this parameter's held words are not the update's base
        writes[n] = ParamWrites(pos, old, (old + 1).astype(np.uint16))
    with pytest.raises(BaseMismatchError):
        write_params(numpy_access(params), writes, parallel=True)
    before["p3"][writes["p3"].prepared[-1]] ^= 1  # the held version's word, per the update
    for n, a in params.items():
        assert np.array_equal(a, before[n]), n
    ok = {n: w for n, w in writes.items() if n != "p3"}
    assert write_params(numpy_access(params), ok, parallel=True) >= 1
    assert all(np.array_equal(params[n][w.prepared], w.new) for n, w in ok.items())


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.uint16, np.float32, np.int64])
def test_check_and_write_is_all_or_nothing_on_every_path(dtype: Any) -> None:
    """One pass where the core has the word size (the words as they are: a float16 parameter
    takes uint16 words, never cast); positions out of order take the general path; a held
    word that is not the update's old word raises, naming the parameter, with nothing
    written."""
    rng = np.random.default_rng(3)
    w = np.dtype(dtype).itemsize
    words = rng.integers(0, 256, 40_000 * w, dtype=np.uint8)
    flat = words.view(dtype)
    raw = flat.view(f"u{w}")
    pos = np.sort(rng.choice(flat.size, 3_000, replace=False)).astype(np.int64)
    old = raw[pos].copy()
    new = (old ^ 1).astype(old.dtype)
    before = flat.copy()
    check_and_write(flat, pos, old, new, "p")
    assert np.array_equal(raw[pos], new)
    check_and_write(flat, pos[::-1].copy(), new[::-1].copy(), old[::-1].copy(), "p")
    assert np.array_equal(flat.view(f"u{w}"), before.view(f"u{w}"))
    bad = old.copy()
    bad[1_500] ^= 2
    for p, o, n in ((pos, bad, new), (pos[::-1].copy(), bad[::-1].copy(), new[::-1].copy())):
        with pytest.raises(BaseMismatchError) as info:
            check_and_write(flat, p, o, n, "layers.0.mlp")
        assert info.value.context.get("param") == "layers.0.mlp"
        assert np.array_equal(flat.view(f"u{w}"), before.view(f"u{w}")), "a refused write wrote"
