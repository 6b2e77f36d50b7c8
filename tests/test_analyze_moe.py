"""``rollpatch analyze`` on mixture-of-experts checkpoints: per-expert and router change rates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rollpatch.analysis import Analysis, analyze_run, render
from rollpatch.analysis.experts import expert_of, expert_step
from rollpatch.cli import main
from rollpatch.formats import cast_view
from rollpatch.io import save_view
from rollpatch.io.checkpoint import load_masters
from rollpatch.patch import diff
from rollpatch.sim import AdamSim, MoEConfig, SimConfig
from rollpatch.view import Tensor, View

E = 8
FORMATS = ("bf16", "nvfp4")
# expert 0 never routed, expert 1 rarely, the rest hot (the same in every MoE layer)
SHARES = (0.0, 0.05) + (1000.0,) * (E - 2)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three consecutive FP32 checkpoints of a ~3M-parameter simulated MoE (layer 0 dense)."""
    d = tmp_path_factory.mktemp("moe")
    moe = MoEConfig(experts=E, top_k=2, dense_layers=1, shares=SHARES)
    sim = AdamSim(SimConfig(n_params=3_000_000, vocab=512, batch_tokens=4096, lr=3e-6, moe=moe))
    paths = []
    for i in range(3):
        if i:
            sim.step()
        paths.append(d / f"step{i}.safetensors")
        ms = sim.masters()
        save_view(
            View({k: Tensor.from_array(np.ascontiguousarray(v)) for k, v in ms.items()}), paths[-1]
        )
    return paths


@pytest.fixture(scope="module")
def result(run: list[Path]) -> Analysis:
    return analyze_run(run, formats=FORMATS, progress=False)


def test_expert_names() -> None:
    assert expert_of("model.layers.12.mlp.experts.7.up_proj.weight") == (12, 7)
    assert expert_of("model.layers.12.mlp.experts.7.up_proj.weight_scale") == (12, 7)
    assert expert_of("model.layers.3.block_sparse_moe.experts.0.w1.weight") == (3, 0)
    assert expert_of("model.layers.3.mlp.experts.gate_up_proj") == (3, None)
    assert expert_of("experts.5.w2") == (-1, 5)
    assert expert_of("model.layers.3.mlp.shared_experts.up_proj.weight") is None
    assert expert_of("model.layers.3.mlp.gate.weight") is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_expert_counts_match_direct_computation(
    run: list[Path], result: Analysis, fmt: str
) -> None:
    views = [cast_view(load_masters(p), fmt) for p in run]
    for i, p in enumerate(result.pairs):
        patch = diff(views[i], views[i + 1])
        ex = p.formats[fmt].experts
        assert ex is not None
        layers = sorted({e.layer for e in ex.experts})
        assert layers == sorted({r.layer for r in ex.routers}) and 0 not in layers
        assert len(ex.experts) == E * len(layers)
        for e in ex.experts:
            names = [n for n in views[i] if expert_of(n) == (e.layer, e.expert)]
            assert len(names) >= 3  # gate, up, down (and nvfp4's scales)
            assert e.elements == sum(views[i][n].n_elements for n in names)
            assert e.changed == sum(patch.tensors[n].n_changed for n in names if n in patch.tensors)
        for r in ex.routers:  # BF16 in every format (the default policy keeps routers)
            names = [n for n in views[i] if n.startswith(f"model.layers.{r.layer}.mlp.gate.")]
            assert names
            assert r.elements == sum(views[i][n].n_elements for n in names)
            assert r.changed == sum(patch.tensors[n].n_changed for n in names if n in patch.tensors)
        fr = np.array([e.changed / e.elements for e in ex.experts])
        q = ex.quantiles()
        assert q["q0"] == fr.min() and q["q100"] == fr.max()
        assert q["q50"] == pytest.approx(float(np.quantile(fr, 0.5)))
        groups = p.formats[fmt].groups
        assert groups["experts"].changed == sum(e.changed for e in ex.experts)
        assert groups["router"].changed == sum(r.changed for r in ex.routers)


def test_skewed_routing_shows_in_the_report(result: Analysis) -> None:
    ex = result.pairs[0].formats["bf16"].experts
    assert ex is not None
    most, least = ex.extremes(3)
    assert {e.expert for e in least[:2]} <= {0, 1}  # never and rarely routed experts
    assert least[0].changed_frac is not None and least[0].changed_frac < 0.001
    assert most[0].changed_frac is not None and most[0].changed_frac > 0.005
    assert all(r.changed > 0 for r in ex.routers)  # routers update every step
    text = render(result)
    assert "Routed experts and routers, bf16" in text
    assert "least changed over the run: L" in text and ".E0 " in text
    assert "router" in text and "experts" in text
    data = result.to_json()
    js = data["pairs"][0]["formats"]["nvfp4"]["experts"]
    assert js["experts"] == len(ex.experts) and set(js["quantiles"]) == {
        "q0",
        "q10",
        "q50",
        "q90",
        "q100",
    }
    assert data["model"]["group_params"]["experts"] > data["model"]["group_params"]["attention"]


def test_fused_expert_tensors_split_by_leading_dim() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 6, 5)).astype(np.float32)
    b = a.copy()
    b[2, 1, 1] += 1.0
    b[2, 3, 0] += 1.0
    b[3, 0, 0] += 1.0
    r = rng.standard_normal((4, 5)).astype(np.float32)
    va = cast_view({"layers.5.mlp.experts.gate_up_proj": a, "layers.5.mlp.gate.weight": r}, "bf16")
    vb = cast_view({"layers.5.mlp.experts.gate_up_proj": b, "layers.5.mlp.gate.weight": r}, "bf16")
    st = expert_step(va, diff(va, vb))
    assert st is not None
    assert [(e.layer, e.expert, e.elements, e.changed) for e in st.experts] == [
        (5, 0, 30, 0),
        (5, 1, 30, 0),
        (5, 2, 30, 2),
        (5, 3, 30, 1),
    ]
    assert [(r.layer, r.changed) for r in st.routers] == [(5, 0)]
    dense = cast_view({"layers.0.mlp.up_proj.weight": r}, "bf16")
    assert expert_step(dense, diff(dense, dense)) is None


def test_cli_reports_experts(run: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", *map(str, run), "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ex = out["pairs"][1]["formats"]["bf16"]["experts"]
    assert ex["least_changed"][0]["expert"] in (0, 1)
    assert main(["analyze", *map(str, run[:2]), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "Routed experts and routers, bf16" in text and "most changed over the run" in text


def test_a_real_transformers_moe_trained_by_torch(tmp_path: Path) -> None:
    """A Qwen3-MoE from transformers, three real AdamW steps on real routing: its state dict
    (fused ``mlp.experts.gate_up_proj`` in transformers 5, or one tensor per expert) goes
    through ``rollpatch analyze`` with every expert accounted for."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    experts, layers = 4, 2
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=2,
    )
    model = Qwen3MoeForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    paths = []
    for i in range(3):
        if i:
            ids = torch.randint(0, 128, (4, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
        paths.append(tmp_path / f"ckpt{i}.safetensors")
        save_view(View({k: Tensor.from_array(v) for k, v in state.items()}), paths[-1])
    result = analyze_run(paths, progress=False)
    groups = result.pairs[0].formats["bf16"].groups
    assert groups["experts"].changed > 0 and groups["router"].changed > 0
    for p in result.pairs:
        ex = p.formats["bf16"].experts
        assert ex is not None
        assert {(e.layer, e.expert) for e in ex.experts} == {
            (layer, e) for layer in range(layers) for e in range(experts)
        }
        assert sum(e.elements for e in ex.experts) == result.group_params["experts"]
        assert [r.layer for r in ex.routers] == list(range(layers))
    assert "Routed experts and routers, bf16" in render(result)
