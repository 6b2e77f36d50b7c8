"""The demo's router replay (``--model moe``): the routing checks, without processes.

A tiny Qwen3-MoE is made here; the built-in runtime generates under a view of it, and
:func:`rollpatch.demo.routing.check_routing` must pass the routing the runtime recorded and
catch each way a response's routing can be wrong (missing, malformed, mislabelled, or not what
transformers routes under the labelled version).
"""

from __future__ import annotations

import base64
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.demo.config import DemoConfig
from rollpatch.demo.grpo import Rollout
from rollpatch.demo.routing import (
    check_routing,
    decode_routed_experts,
    moe_layers,
    pick_spread,
    routing_invariant,
    routing_line,
)
from rollpatch.errors import ConfigError


def _encode(rows: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _rollout(version: int, island: str = "local", **kw: Any) -> Rollout:
    base = {
        "group": 0,
        "digit": 1,
        "prompt": (1, 2, 3),
        "seed": version,
        "token": 5,
        "logprob": -1.0,
        "version_start": version,
        "version_end": version,
        "island": island,
        "reward": 0.0,
    }
    return Rollout(**{**base, **kw})  # type: ignore[arg-type]


def test_decode_refuses_what_is_not_a_routing_array() -> None:
    rows = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    assert np.array_equal(decode_routed_experts(_encode(rows)), rows)
    for bad in ("not base64!", base64.b64encode(b"junk").decode(), _encode(np.zeros((3, 2)))):
        with pytest.raises(ConfigError):
            decode_routed_experts(bad)
    with pytest.raises(ConfigError):  # an object array would need pickle: refused
        decode_routed_experts(_encode(np.zeros((1, 1, 1), dtype=np.float32)))


def test_moe_layers_follow_the_config() -> None:
    assert moe_layers({"num_hidden_layers": 4}) == 4  # Mixtral: every layer
    assert moe_layers({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == 2
    assert moe_layers({"num_hidden_layers": 4, "mlp_only_layers": [0]}) == 3


def test_pick_spread_covers_versions_and_islands() -> None:
    rs = [_rollout(v, isl) for v in range(20) for isl in ("local", "eu", "us") for _ in range(3)]
    sample = pick_spread(rs, 16)
    keys = [(r.version, r.island) for r in sample]
    assert len(sample) == 16 and len(set(keys)) == 16
    assert {v for v, _ in keys} >= {0, 19} and {i for _, i in keys} == {"local", "eu", "us"}
    assert len(pick_spread(rs[:6], 16)) == 2  # one per (version, island)


def test_config_model_is_a_checked_mode() -> None:
    cfg = DemoConfig(model="moe", experts=4, top_k=2)
    assert DemoConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="model"):
        DemoConfig(model="mixtral")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="top_k"):
        DemoConfig(model="moe", experts=4, top_k=5)
    with pytest.raises(ConfigError, match="built-in engine"):
        DemoConfig(model="moe", engine="vllm", engine_urls=("http://a", "http://b", "http://c"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, list[int], np.ndarray]:
    """A tiny MoE, its runtime (v0 = the model's bits), a prompt and the runtime's routing."""
    pytest.importorskip("transformers")
    from rollpatch.engines.reference import ReferenceRuntime, make_tiny_moe_model

    path = make_tiny_moe_model(
        tmp_path_factory.mktemp("moe") / "model", vocab_size=512, hidden_size=64, seed=3
    )
    rt = ReferenceRuntime(path, threads=1)
    prompt = [1, 40, 17, 99, 300]
    gen = rt.generate(prompt, max_tokens=1, temperature=1.0, seed=5, logprobs=0)
    next(gen)
    rows = gen.routed_experts()
    gen.close()
    assert rows is not None and rows.shape == (len(prompt), 2, 2)
    return path, rt, prompt, rows


def test_check_routing_passes_the_engines_routing_and_catches_each_fault(
    moe: tuple[Path, Any, list[int], np.ndarray], tmp_path: Path
) -> None:
    path, rt, prompt, rows = moe
    n = len(prompt)
    good = _rollout(0, prompt=tuple(prompt), routed_experts=_encode(rows), spans=((0, n, 0),))
    views = {0: rt.view}
    rep = check_routing(path, views, [good], [good], tmp_path / "ok")
    assert (rep.responses, rep.carried, rep.problems, rep.replayed) == (1, 1, [], 1)
    assert rep.replay_tokens == n and rep.replay_mismatches == []
    assert rep.to_json()["by_version"] == {
        "0": {"responses": 1, "with_routed_experts": 1, "shapes": {f"{n}x2x2": 1}}
    }
    assert routing_invariant(rep.to_json(), {})["ok"] is True

    swapped = rows.copy()
    swapped[2, 1] = (swapped[2, 1] + 1) % 8  # one expert of one token in one layer
    if np.array_equal(np.sort(swapped[2, 1]), np.sort(rows[2, 1])):
        swapped[2, 1, 0] = (swapped[2, 1, 0] + 3) % 8
    faults = {
        "missing": replace(good, routed_experts=None),
        "malformed": replace(good, routed_experts="???"),
        "short": replace(good, routed_experts=_encode(rows[1:])),
        "out of range": replace(good, routed_experts=_encode(np.full_like(rows, 8))),
        "mislabelled": replace(good, spans=((0, n, 1),)),
        "split": replace(good, spans=((0, 2, 0), (2, n, 1))),
    }
    for what, bad in faults.items():
        rep = check_routing(path, views, [good, bad], [good], tmp_path / "bad")
        assert len(rep.problems) == 1, what
        assert routing_invariant(rep.to_json(), {})["ok"] is False, what
    wrong = replace(good, routed_experts=_encode(swapped))
    rep = check_routing(path, views, [wrong], [wrong], tmp_path / "wrong")
    assert rep.problems == [] and rep.replayed == 1
    assert [m["tokens"] for m in rep.replay_mismatches] == [[2]]
    verdict = routing_invariant(rep.to_json(), {})
    assert verdict["ok"] is False and "1 differ" in verdict["detail"]


def test_routing_line_names_the_versions_that_lackedrouting_invariant() -> None:
    rt: dict[str, Any] = {
        "model": {"experts": 8, "top_k": 2, "moe_layers": 2},
        "responses": 48,
        "with_routed_experts": 48,
        "shapes": {"4x2x2": 48},
        "by_version": {
            str(v): {"responses": 4, "with_routed_experts": 4, "shapes": {}} for v in range(12)
        },
    }
    line = routing_line(rt)
    assert all(len(x) <= 100 for x in line.splitlines())
    line = " ".join(line.split())
    assert "48 of 48" in line and "every version v0..v11" in line and "4x2x2 (48)" in line
    rt["by_version"]["7"]["with_routed_experts"] = 1
    rt["with_routed_experts"] = 45
    line = " ".join(routing_line(rt).split())  # unwrapped
    assert "45 of 48" in line and "missing in v7 (3 of 4)" in line
