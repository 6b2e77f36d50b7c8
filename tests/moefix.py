"""The MoE vLLM tests' world (tests/test_moe_vllm*.py): vLLM's own expert weight loader run on
stand-in layers, simulated ranks holding expert parameters, and a worker extension that runs
the loader inside the live MoE server's worker (vLLM is imported there already: no second
process pays vLLM's ≈15 s import).

:class:`Extension` is rollpatch's :class:`~rollpatch.engines.vllm.WorkerExtension` plus
``rollpatch_test_expert_loader``; the live MoE server is started with it
(``--worker-extension-cls tests.moefix.Extension``, the repository on ``PYTHONPATH``).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import numpy as np

from rollpatch.engines.vllm import WorkerExtension
from rollpatch.engines.vllm.layout import ParamSpec, param_shape
from rollpatch.engines.vllm.moe import expert_spec
from rollpatch.kinds import get_kind
from rollpatch.view import Tensor, View
from tests.vllm_layouts import Ranks

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
EXTENSION = "tests.moefix.Extension"


def names(e: int) -> dict[str, str]:
    return {
        s: f"{PREFIX}.experts.{e}.{p}.weight"
        for s, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    }


def checkpoint(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for e in range(E):
        for s, n in names(e).items():
            shape = (HID, INTER) if s == "w2" else (INTER, HID)
            out[n] = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    return out


def run_vllm_loader(src: str, dst: str) -> None:
    """What vLLM does: its own ``RoutedExperts.weight_loader`` on a stand-in layer per case and
    rank (no model, no config), for the checkpoints ``src/{a,b}.npz``; results to ``dst``."""
    import torch
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    out = {}
    for ck_id in ("a", "b"):
        with np.load(f"{src}/{ck_id}.npz", allow_pickle=False) as ck:
            for name, ranks, ep, strategy in CASES:
                t = 1 if ep else ranks
                for r in range(ranks):
                    n_local, m, _ = determine_expert_map(
                        ranks if ep else 1, r if ep else 0, E, strategy
                    )
                    local = list(range(E)) if m is None else [int(x) for x in m.tolist()]
                    out[f"{name}/{r}/map"] = np.array(local)
                    w13 = torch.full((n_local, 2 * INTER // t, HID), -1, dtype=torch.int32)
                    w2 = torch.full((n_local, HID, INTER // t), -1, dtype=torch.int32)
                    s = _stand_in(RoutedExperts, local, 0 if ep else r, t)
                    for e in range(E):
                        for shard, n in names(e).items():
                            w = torch.from_numpy(ck[n].astype(np.int32))
                            dst_w = w2 if shard == "w2" else w13
                            RoutedExperts.weight_loader(s, dst_w, w, n, shard, e)
                    out[f"{name}/{r}/{ck_id}/w13"] = w13.numpy()
                    out[f"{name}/{r}/{ck_id}/w2"] = w2.numpy()
    np.savez(dst, **out)


def _stand_in(cls: Any, local: list[int], tp_rank: int, t: int) -> Any:
    s = types.SimpleNamespace(
        quant_config=None,
        quant_method=types.SimpleNamespace(),
        _fused_shared_expert_quantizer=None,
        moe_config=types.SimpleNamespace(
            is_act_and_mul=True,
            tp_rank=tp_rank,
            tp_shard_with_padding=False,
            num_logical_experts=E,
            moe_parallel_config=types.SimpleNamespace(tp_size=t),
        ),
        expert_map_manager=types.SimpleNamespace(
            map_global_to_local=lambda g: local[g], num_fused_shared_experts=0
        ),
    )
    for fn in (
        "_map_global_expert_id_to_local_expert_id",
        "_load_w13",
        "_load_w2",
        "_load_model_weight_or_group_weight_scale",
        "_narrow_expert_data_for_padding",
        "_get_hidden_dim",
    ):
        f = getattr(cls, fn)
        static = isinstance(inspect.getattr_static(cls, fn), staticmethod)
        setattr(s, fn, f if static else types.MethodType(f, s))
    return s


class Extension(WorkerExtension):
    """rollpatch's worker extension plus the stand-in loader (tests only)."""

    def rollpatch_test_expert_loader(self, src: str, dst: str) -> dict[str, Any]:
        """Run :func:`run_vllm_loader` in this worker (vLLM already imported)."""
        run_vllm_loader(src, dst)
        return {"ok": True}


def specs(loaded: dict[str, np.ndarray], name: str, ranks: int, ep: bool) -> list[ParamSpec]:
    """The specs :mod:`.describe` builds, with the expert maps vLLM computed."""
    maps = [[int(x) for x in loaded[f"{name}/{r}/map"]] for r in range(ranks)]
    t = 1 if ep else ranks
    return [
        expert_spec(
            f"{PREFIX}.experts.routed_experts.w13_weight",
            [[names(e)["w1"], names(e)["w3"]] for e in range(E)],
            (INTER, HID),
            maps,
            expert_tp=t,
            dim=0,
        ),
        expert_spec(
            f"{PREFIX}.experts.routed_experts.w2_weight",
            [[names(e)["w2"]] for e in range(E)],
            (HID, INTER),
            maps,
            expert_tp=t,
            dim=1,
        ),
    ]


def view(ck: dict[str, np.ndarray]) -> View:
    return View({n: Tensor(get_kind("bf16"), a.shape, a.reshape(-1).copy()) for n, a in ck.items()})


class MoeRanks(Ranks):
    """``ranks`` simulated vLLM ranks holding expert parameters (zeros until loaded)."""

    def __init__(self, specs: list[ParamSpec], ranks: int) -> None:
        params = [
            {s.param: np.zeros(param_shape(s, ranks), np.uint16) for s in specs}
            for _ in range(ranks)
        ]
        super().__init__(specs, params)


def same_as_vllm(ranks: MoeRanks, loaded: dict[str, np.ndarray], name: str, ck_id: str) -> None:
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
