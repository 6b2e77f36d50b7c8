"""Synthetic vLLM layouts for the offline tests (vLLM, SGLang): one Llama layer's
:class:`ParamSpec` s at any TP size, a reference of what vLLM's weight loaders put on each rank
(written independently of the layout module), tensor-parallel ranks simulated with threads,
and random steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from rollpatch.engines.vllm.layout import ParamSpec, Shard, param_shape, storage_offsets
from rollpatch.engines.vllm.weights import Access, RuntimeWeights
from rollpatch.kinds import get_kind
from rollpatch.view import Tensor, View

HID, HEADS, HD, FF, VOCAB = 64, 8, 8, 96, 200


def layer_specs(tp: int, kv_heads: int = 2) -> list[ParamSpec]:
    heads, kv = HEADS // tp, max(1, kv_heads // tp)
    rep = max(1, tp // kv_heads)
    padded = -(-VOCAB // 64) * 64
    return [
        ParamSpec(
            "qkv_proj.weight",
            "column",
            (
                Shard("q_proj.weight", (HEADS * HD, HID), heads * HD),
                Shard("k_proj.weight", (kv_heads * HD, HID), kv * HD, rep),
                Shard("v_proj.weight", (kv_heads * HD, HID), kv * HD, rep),
            ),
        ),
        ParamSpec(
            "qkv_proj.bias",
            "column",
            (
                Shard("q_proj.bias", (HEADS * HD,), heads * HD),
                Shard("k_proj.bias", (kv_heads * HD,), kv * HD, rep),
                Shard("v_proj.bias", (kv_heads * HD,), kv * HD, rep),
            ),
        ),
        ParamSpec("o_proj.weight", "row", (Shard("o_proj.weight", (HID, HEADS * HD)),)),
        ParamSpec(
            "gate_up_proj.weight",
            "column",
            (Shard("gate_proj.weight", (FF, HID)), Shard("up_proj.weight", (FF, HID))),
        ),
        ParamSpec("down_proj.weight", "row", (Shard("down_proj.weight", (HID, FF)),)),
        ParamSpec(
            "embed_tokens.weight",
            "vocab",
            (Shard("embed_tokens.weight", (VOCAB, HID)),),
            padded=padded,
        ),
        ParamSpec(
            "lm_head.weight", "vocab", (Shard("lm_head.weight", (VOCAB, HID)),), padded=padded
        ),
        ParamSpec("norm.weight", "replicated", (Shard("norm.weight", (HID,)),)),
    ]


def checkpoint(seed: int = 0, kv_heads: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        sh.name: rng.integers(0, 1 << 16, sh.shape, dtype=np.uint16)
        for spec in layer_specs(1, kv_heads)
        for sh in spec.shards
    }


def vllm_load(
    ck: dict[str, np.ndarray], tp: int, rank: int, kv_heads: int = 2
) -> dict[str, np.ndarray]:
    """What vLLM's weight loaders put in each parameter of ``rank`` — written independently of
    the layout module, after QKVParallelLinear / MergedColumnParallelLinear /
    RowParallelLinear / VocabParallelEmbedding.weight_loader."""
    heads, kv = HEADS // tp, max(1, kv_heads // tp)
    kv_rank = rank // max(1, tp // kv_heads)
    q0, k0 = rank * heads * HD, kv_rank * kv * HD

    def qkv(s: str) -> np.ndarray:
        return np.concatenate(
            [
                ck[f"q_proj.{s}"][q0 : q0 + heads * HD],
                ck[f"k_proj.{s}"][k0 : k0 + kv * HD],
                ck[f"v_proj.{s}"][k0 : k0 + kv * HD],
            ]
        )

    f0, c0, o0 = rank * FF // tp, rank * FF // tp, rank * HEADS * HD // tp
    per = -(-VOCAB // 64) * 64 // tp

    def vocab(name: str) -> np.ndarray:
        out = np.zeros((per, HID), np.uint16)
        lo, hi = min(rank * per, VOCAB), min((rank + 1) * per, VOCAB)
        out[: hi - lo] = ck[name][lo:hi]
        return out

    return {
        "qkv_proj.weight": qkv("weight"),
        "qkv_proj.bias": qkv("bias"),
        "o_proj.weight": ck["o_proj.weight"][:, o0 : o0 + HEADS * HD // tp],
        "gate_up_proj.weight": np.concatenate(
            [ck["gate_proj.weight"][f0 : f0 + FF // tp], ck["up_proj.weight"][f0 : f0 + FF // tp]]
        ),
        "down_proj.weight": ck["down_proj.weight"][:, c0 : c0 + FF // tp],
        "embed_tokens.weight": vocab("embed_tokens.weight"),
        "lm_head.weight": vocab("lm_head.weight"),
        "norm.weight": ck["norm.weight"],
    }


class Ranks:
    """``tp`` simulated vLLM ranks over ``params`` (one dict of arrays per rank), each with a
    :class:`RuntimeWeights`; ``gather`` is a real collective (a barrier per call), so ranks
    must run in lockstep (:meth:`run` runs one function on every rank, in threads)."""

    def __init__(
        self,
        specs: list[ParamSpec],
        params: list[dict[str, np.ndarray]],
        split: bool = True,
        p2p: bool = True,
    ) -> None:
        self.tp = len(params)
        self.params = params
        self.split = split  # each tensor decoded by one rank (gather_to, share)
        self.p2p = p2p  # results sent point to point, each rank its block's (deliver)
        self.mail: list[list[bytes]] = [[b""] * self.tp for _ in range(self.tp)]
        self.received = [0] * self.tp  # bytes of results received from other ranks
        self.slots: list[np.ndarray | None] = [None] * self.tp
        self.shared: bytes | None = None
        self.gathers = [0] * self.tp  # all-gathers (gather) per rank
        self.gathered_to = [0] * self.tp  # gather_to calls per rank
        self.owned = [0] * self.tp  # of them, tensors gathered to the rank
        self.barrier = threading.Barrier(self.tp, timeout=120)  # a rank left alone: fails, no hang
        self.repacked: list[set[str]] = []
        kinds = {s.param: get_kind("bf16") for s in specs}
        self.weights = [
            RuntimeWeights(specs, kinds, self._access(r), rank=r, tp=self.tp)
            for r in range(self.tp)
        ]

    def _access(self, r: int) -> Access:
        ps = self.params[r]

        def write(p: str, off: np.ndarray, vals: np.ndarray) -> None:
            a = ps[p]
            elem = [s // a.itemsize for s in a.strides]
            flat = np.lib.stride_tricks.as_strided(a, shape=(a.size,), strides=(a.itemsize,))
            flat[storage_offsets(off, a.shape, elem)] = vals

        def block(p: str, idx: tuple[slice, slice], b: np.ndarray) -> None:
            ps[p][idx] = b

        def gather(p: str, local: np.ndarray) -> list[np.ndarray]:
            self.gathers[r] += 1
            return allgather(local)

        def allgather(local: np.ndarray) -> list[np.ndarray]:
            self.slots[r] = local.copy()
            self.barrier.wait()
            out = [s.copy() for s in self.slots]  # type: ignore[union-attr]
            self.barrier.wait()
            return out

        def gather_to(p: str, local: np.ndarray, dst: int) -> Callable[[], list[np.ndarray] | None]:
            self.gathered_to[r] += 1  # done at once here (vLLM's: started, finished later)
            got = allgather(local)
            if r == dst:
                self.owned[r] += 1
                return lambda: got
            return lambda: None

        def share(data: bytes | None, src: int, size: int) -> memoryview:
            if r == src:
                assert data is not None and len(data) == size
                self.shared = data
            self.barrier.wait()
            out = memoryview(bytes(self.shared or b""))
            self.barrier.wait()
            if r != src:
                self.received[r] += len(out)
            return out

        def deliver(parts: list[bytes], sizes: list[int]) -> list[memoryview]:
            self.mail[r] = list(parts)
            self.barrier.wait()
            out = [memoryview(b"" if q == r else bytes(self.mail[q][r])) for q in range(self.tp)]
            self.barrier.wait()
            assert [len(o) for q, o in enumerate(out) if q != r] == [
                s for q, s in enumerate(sizes) if q != r
            ]
            self.received[r] += sum(len(o) for o in out)
            return out

        return Access(
            lambda p: ps[p],
            write,
            block,
            self.repacked.append,
            gather if self.tp > 1 else None,
            aliases=True,
            gather_to=gather_to if self.tp > 1 and self.split else None,
            share=share if self.tp > 1 and self.split else None,
            deliver=deliver if self.tp > 1 and self.split and self.p2p else None,
            delivers=(lambda: True) if self.tp > 1 and self.split and self.p2p else None,
        )

    def run(self, fn: Callable[[RuntimeWeights], Any]) -> list[Any]:
        out: list[Any] = [None] * self.tp

        def one(r: int) -> None:
            try:
                out[r] = fn(self.weights[r])
            except Exception as e:  # noqa: BLE001 - compared by the test
                out[r] = e

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out


class SimulatedRanks(Ranks):
    """``tp`` ranks holding :func:`vllm_load` parameters (Fortran order when ``strided``)."""

    def __init__(
        self,
        ck: dict[str, np.ndarray],
        tp: int,
        strided: bool = False,
        split: bool = True,
        p2p: bool = True,
    ) -> None:
        params = []
        for r in range(tp):
            ps = {}
            for spec in layer_specs(tp):
                a = vllm_load(ck, tp, r)[spec.param].reshape(param_shape(spec, tp))
                ps[spec.param] = np.asfortranarray(a) if strided else a.copy()
            params.append(ps)
        super().__init__(layer_specs(tp), params, split, p2p)


def words_view(ck: dict[str, np.ndarray]) -> View:
    return View({n: Tensor(get_kind("bf16"), a.shape, a.reshape(-1).copy()) for n, a in ck.items()})


def random_step(ck: dict[str, np.ndarray], seed: int, share: float = 0.05) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for n, a in ck.items():
        b = a.copy()
        pick = rng.random(a.shape) < share
        b[pick] = rng.integers(0, 1 << 16, int(pick.sum()), dtype=np.uint16)
        out[n] = b
    return out
