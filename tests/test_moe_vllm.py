"""MoE expert tensors in vLLM's runtime coordinates, checked against vLLM's own loaders.

vLLM's ``RoutedExperts.weight_loader`` (run in the vLLM venv, in a subprocess, on a stand-in
layer) and ``determine_expert_map`` fill each rank's ``w13_weight``/``w2_weight`` from
per-expert checkpoint tensors, under tensor parallelism (TP 1, 2, 3) and expert parallelism
(linear and round-robin placement). rollpatch's placements (:mod:`rollpatch.engines.vllm.moe`)
must put every element in the same place: a keyframe load, reads, digests, and a patch's
in-place scatter on simulated ranks all end bit-identical to what vLLM's loader writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.vllm.layout import ParamSpec, check_coverage, param_shape, storage_offsets
from rollpatch.engines.vllm.moe import expert_spec
from rollpatch.engines.vllm.weights import Access, RuntimeWeights
from rollpatch.errors import EngineError
from rollpatch.kinds import get_kind
from rollpatch.patch import diff
from rollpatch.view import Tensor, View

from . import vllm_env

E, INTER, HID = 8, 12, 6
#: (name, ranks, expert parallel, placement strategy)
CASES = [
    ("tp1", 1, False, "linear"),
    ("tp2", 2, False, "linear"),
    ("tp3", 3, False, "linear"),
    ("ep2", 2, True, "linear"),
    ("ep4rr", 4, True, "round_robin"),
]
PREFIX = "model.layers.0.mlp"


def _names(e: int) -> dict[str, str]:
    return {
        s: f"{PREFIX}.experts.{e}.{p}.weight"
        for s, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    }


def _checkpoint(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for e in range(E):
        for s, n in _names(e).items():
            shape = (HID, INTER) if s == "w2" else (INTER, HID)
            out[n] = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    return out


# What vLLM does: its own weight_loader on a stand-in RoutedExperts (no model, no config).
_LOADER = r"""
import inspect, json, sys, types
import numpy as np, torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
E, I, H, cases, src, dst = json.loads(sys.argv[1])
out = {}
for ck_id in ("a", "b"):
    ck = np.load(f"{src}/{ck_id}.npz", allow_pickle=False)
    for name, ranks, ep, strategy in cases:
        t = 1 if ep else ranks
        for r in range(ranks):
            n_local, m, _ = determine_expert_map(ranks if ep else 1, r if ep else 0, E, strategy)
            local = list(range(E)) if m is None else [int(x) for x in m.tolist()]
            out[f"{name}/{r}/map"] = np.array(local)
            w13 = torch.full((n_local, 2 * I // t, H), -1, dtype=torch.int32)
            w2 = torch.full((n_local, H, I // t), -1, dtype=torch.int32)
            s = types.SimpleNamespace(
                quant_config=None, quant_method=types.SimpleNamespace(),
                _fused_shared_expert_quantizer=None,
                moe_config=types.SimpleNamespace(
                    is_act_and_mul=True, tp_rank=0 if ep else r, tp_shard_with_padding=False,
                    num_logical_experts=E,
                    moe_parallel_config=types.SimpleNamespace(tp_size=t)),
                expert_map_manager=types.SimpleNamespace(
                    map_global_to_local=lambda g, local=local: local[g],
                    num_fused_shared_experts=0),
            )
            for fn in ("_map_global_expert_id_to_local_expert_id", "_load_w13", "_load_w2",
                       "_load_model_weight_or_group_weight_scale",
                       "_narrow_expert_data_for_padding", "_get_hidden_dim"):
                f = getattr(RoutedExperts, fn)
                static = isinstance(inspect.getattr_static(RoutedExperts, fn), staticmethod)
                setattr(s, fn, f if static else types.MethodType(f, s))
            for e in range(E):
                for shard, part in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                    n = f"model.layers.0.mlp.experts.{e}.{part}.weight"
                    w = torch.from_numpy(ck[n].astype(np.int32))
                    RoutedExperts.weight_loader(s, w2 if shard == "w2" else w13, w, n, shard, e)
            out[f"{name}/{r}/{ck_id}/w13"] = w13.numpy()
            out[f"{name}/{r}/{ck_id}/w2"] = w2.numpy()
np.savez(dst, **out)
"""


@pytest.fixture(scope="module")
def vllm_loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    if os.environ.get("ROLLPATCH_SKIP_VLLM") == "1":
        pytest.skip("ROLLPATCH_SKIP_VLLM=1: the vLLM tests are skipped on request")
    python = vllm_env.vllm_python()
    if python is None:
        pytest.fail(f"no vLLM venv at {vllm_env.venv_dir()}: {vllm_env.BUILD_HINT}", pytrace=False)
    tmp = tmp_path_factory.mktemp("moe-vllm")
    for ck_id, seed in (("a", 0), ("b", 1)):
        np.savez(tmp / f"{ck_id}.npz", **_checkpoint(seed))
    arg = json.dumps([E, INTER, HID, CASES, str(tmp), str(tmp / "out.npz")])
    r = subprocess.run(
        [str(python), "-c", _LOADER, arg],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(tmp / "out.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _specs(loaded: dict[str, np.ndarray], name: str, ranks: int, ep: bool) -> list[ParamSpec]:
    """The specs :mod:`.describe` builds, with the expert maps vLLM computed."""
    maps = [[int(x) for x in loaded[f"{name}/{r}/map"]] for r in range(ranks)]
    t = 1 if ep else ranks
    return [
        expert_spec(
            f"{PREFIX}.experts.routed_experts.w13_weight",
            [[_names(e)["w1"], _names(e)["w3"]] for e in range(E)],
            (INTER, HID),
            maps,
            expert_tp=t,
            dim=0,
        ),
        expert_spec(
            f"{PREFIX}.experts.routed_experts.w2_weight",
            [[_names(e)["w2"]] for e in range(E)],
            (HID, INTER),
            maps,
            expert_tp=t,
            dim=1,
        ),
    ]


def _view(ck: dict[str, np.ndarray]) -> View:
    return View({n: Tensor(get_kind("bf16"), a.shape, a.reshape(-1).copy()) for n, a in ck.items()})


class MoeRanks:
    """``ranks`` simulated vLLM ranks holding expert parameters (zeros until loaded), each with
    a :class:`RuntimeWeights`; ``gather`` is a real collective (ranks run in threads)."""

    def __init__(self, specs: list[ParamSpec], ranks: int) -> None:
        self.tp = ranks
        self.params = [
            {s.param: np.zeros(param_shape(s, ranks), np.uint16) for s in specs}
            for _ in range(ranks)
        ]
        self.slots: list[np.ndarray | None] = [None] * ranks
        self.barrier = threading.Barrier(ranks)
        kinds = {s.param: get_kind("bf16") for s in specs}
        self.weights = [
            RuntimeWeights(specs, kinds, self._access(r), rank=r, tp=ranks) for r in range(ranks)
        ]

    def _access(self, r: int) -> Access:
        ps = self.params[r]

        def write(p: str, off: np.ndarray, vals: np.ndarray) -> None:
            a = ps[p]
            flat = a.reshape(-1)
            flat[storage_offsets(off, a.shape, [s // a.itemsize for s in a.strides])] = vals

        def block(p: str, idx: tuple[slice, slice], b: np.ndarray) -> None:
            ps[p][idx] = b

        def gather(p: str, local: np.ndarray) -> list[np.ndarray]:
            self.slots[r] = local.copy()
            self.barrier.wait()
            out = [s.copy() for s in self.slots]  # type: ignore[union-attr]
            self.barrier.wait()
            return out

        return Access(
            lambda p: ps[p],
            write,
            block,
            lambda names: None,
            gather if self.tp > 1 else None,
            aliases=True,
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


def _same_as_vllm(ranks: MoeRanks, loaded: dict[str, np.ndarray], name: str, ck_id: str) -> None:
    for r in range(ranks.tp):
        for part in ("w13", "w2"):
            want = loaded[f"{name}/{r}/{ck_id}/{part}"]
            got = ranks.params[r][f"{PREFIX}.experts.routed_experts.{part}_weight"]
            assert (want >= 0).all(), "vLLM's loader left a slot unwritten"
            assert np.array_equal(got.reshape(want.shape), want.astype(np.uint16)), (
                name,
                r,
                part,
                ck_id,
            )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_expert_placement_equals_vllms_loader(
    vllm_loaded: dict[str, np.ndarray], case: tuple[str, int, bool, str]
) -> None:
    name, ranks, ep, _ = case
    specs = _specs(vllm_loaded, name, ranks, ep)
    assert set(check_coverage(specs, ranks)) == set(_checkpoint(0))
    sim = MoeRanks(specs, ranks)
    a, b = _view(_checkpoint(0)), _view(_checkpoint(1))
    # a keyframe load writes what vLLM's loader writes, on every rank
    assert sim.run(lambda w: w.load(a)) == [a.digest()] * ranks
    _same_as_vllm(sim, vllm_loaded, name, "a")
    # reads in checkpoint coordinates give the checkpoint back (digests, fresh)
    assert sim.run(lambda w: w.digests(fresh=True)) == [a.tensor_digests()] * ranks
    # a patch scatters in place exactly where vLLM would load the new checkpoint
    patch = diff(a, b)
    got = sim.run(lambda w: w.commit(patch))
    assert all(isinstance(g, dict) for g in got), got
    _same_as_vllm(sim, vllm_loaded, name, "b")
    assert sim.run(lambda w: w.root()) == [b.digest()] * ranks
    # a patch on the wrong base is refused on every rank and writes nothing
    out = sim.run(lambda w: w.commit(diff(a, b)))
    assert all(isinstance(e, Exception) for e in out), out
    _same_as_vllm(sim, vllm_loaded, name, "b")


def test_bad_expert_layouts_are_refused() -> None:
    names = [[_names(e)["w1"], _names(e)["w3"]] for e in range(E)]
    every = [list(range(E))] * 2
    with pytest.raises(EngineError, match="divide"):
        expert_spec("w13", names, (INTER + 1, HID), every, expert_tp=2, dim=0)
    half = [[e if e < 4 else -1 for e in range(E)], [-1] * 4 + list(range(4))]
    with pytest.raises(EngineError, match="cover"):  # EP, but an expert on two ranks
        expert_spec("w13", names, (INTER, HID), [list(range(E)), half[1]], expert_tp=1, dim=0)
    with pytest.raises(EngineError, match="slots"):
        expert_spec("w13", names, (INTER, HID), [[0] * E, [0] * E], expert_tp=2, dim=0)
    with pytest.raises(EngineError, match="same tensors"):
        expert_spec("w13", names[:-1] + [names[0][:1]], (INTER, HID), every, expert_tp=2, dim=0)
    spec = expert_spec("w13", names, (INTER, HID), half, expert_tp=1, dim=0)
    assert param_shape(spec, 2) == (4, 2 * INTER * HID)
