"""The demo's trainer side, pure and fast: the GRPO math, the staleness filter, the request
seeds, the label check's sample, the live view's density line, the config and the warm-up.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollpatch.demo.config import DemoConfig
from rollpatch.demo.grpo import (
    Rollout,
    clipped_surrogate,
    group_advantages,
    importance_ratio,
    split_by_lag,
)
from rollpatch.demo.rollout import request_seed
from rollpatch.demo.verify import pick_sample
from rollpatch.errors import ConfigError

# -- GRPO math ---------------------------------------------------------------------------------


def test_group_advantages() -> None:
    adv = group_advantages([1, 0, 0, 0], eps=0.0)
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5])  # mean .25, sample std .5
    assert group_advantages([1, 1, 1]) == pytest.approx([0, 0, 0])
    assert group_advantages([1, 0], normalize=False) == pytest.approx([0.5, -0.5])
    with pytest.raises(ValueError):
        group_advantages([1.0])


def test_clipped_surrogate_numpy() -> None:
    rho = np.array([1.5, 0.5, 0.5, 1.5])
    adv = np.array([1.0, 1.0, -1.0, -1.0])
    old = np.zeros(4)
    loss, stats = clipped_surrogate(np.log(rho), old, adv, clip=0.2)
    # min(rho A, clip(rho) A): 1.2 (clipped), 0.5, -0.8 (clipped), -1.5
    assert loss == pytest.approx(-(1.2 + 0.5 - 0.8 - 1.5) / 4)
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert importance_ratio(np.log(rho), old) == pytest.approx(rho)


def test_clipped_surrogate_torch_gradients() -> None:
    torch = pytest.importorskip("torch")
    rho = torch.tensor([1.5, 0.5, 0.5, 1.5], dtype=torch.float64)
    logp = rho.log().clone().requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    loss, _ = clipped_surrogate(logp, torch.zeros(4, dtype=torch.float64), adv, 0.2)
    loss.backward()
    # clipped terms pass no gradient; the others d(-rho A / n)/dlogp = -rho A / n
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4])
    np_loss, _ = clipped_surrogate(rho.log().numpy(), np.zeros(4), adv.numpy(), 0.2)
    assert float(loss.detach()) == pytest.approx(np_loss)


def _rollout(group: int, version: int, island: str = "local", reward: float = 0.0) -> Rollout:
    return Rollout(
        group=group,
        digit=1,
        prompt=(0, 1),
        seed=group,
        token=5,
        logprob=-2.3,
        version_start=version,
        version_end=version,
        island=island,
        reward=reward,
    )


def test_split_by_lag_keeps_or_drops_whole_groups() -> None:
    fresh = [_rollout(0, 5), _rollout(0, 4)]
    edge = [_rollout(1, 3), _rollout(1, 3)]
    stale = [_rollout(2, 4), _rollout(2, 2)]  # one member too old: the whole group goes
    kept, dropped, used, lost = split_by_lag([fresh, edge, stale], current=5, max_lag=2)
    assert kept == [fresh, edge] and dropped == [stale]
    assert dict(used) == {0: 1, 1: 1, 2: 2}
    assert dict(lost) == {1: 1, 3: 1}


def test_request_seeds_are_distinct_and_reproducible() -> None:
    seeds = {request_seed(0, g, m) for g in range(50) for m in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(3, 7, 1) == request_seed(3, 7, 1) != request_seed(4, 7, 1)


def test_pick_sample_spreads_over_islands_and_versions() -> None:
    rs = [
        _rollout(i, v, isl)
        for i, (v, isl) in enumerate(
            [(v, isl) for v in range(4) for isl in ("local", "eu") for _ in range(5)]
        )
    ]
    sample = pick_sample(rs, 8)
    assert {(r.island, r.version) for r in sample} == {
        (i, v) for i in ("local", "eu") for v in range(4)
    }
    assert pick_sample(rs, 0) == rs


def test_density_beside_the_reward(tmp_path: Path) -> None:
    """The live view and the step lines show, for the newest published step, the share of
    served values it changed and its patch's size relative to the full view."""
    from rollpatch.demo.live import density
    from rollpatch.demo.monitor import Monitor

    m = Monitor(DemoConfig(out=str(tmp_path)), (tmp_path / "board").as_uri(), [])
    assert density(m) == "changed -  patch -"
    m.ready = {"n_elements": 1000, "full_view_bytes": 2000}
    m.published = {
        0: {"changed": 0, "patch_bytes": 0},
        1: {"changed": 25, "patch_bytes": 30},
        2: {"changed": 20, "patch_bytes": 18},
    }
    assert density(m) == "v2 changed 2.0% patch 0.9%"


def test_config_validates_and_round_trips() -> None:
    cfg = DemoConfig(steps=3, wan_mbps=2.5, engine_urls=())
    assert DemoConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError):
        DemoConfig(max_lag=-1)
    with pytest.raises(ConfigError):
        DemoConfig(format="nvfp4")  # the reference engine cannot serve it
    with pytest.raises(ConfigError):
        DemoConfig(engine="vllm")  # needs one URL per island
    real = DemoConfig(regime="real", lr=2e-6)
    assert DemoConfig.from_json(real.to_json()) == real
    with pytest.raises(ConfigError, match="regime"):
        DemoConfig(regime="slow")  # type: ignore[arg-type]


def test_real_regime_warm_up_is_supervised_on_the_task(tmp_path: Path) -> None:
    """The real regime's unpublished warm-up leaves a partly skilled policy (RL refines it);
    the fast regime's format warm-up leaves the right answer at chance."""
    pytest.importorskip("transformers")
    import torch

    from rollpatch.demo.policy import _last_logprobs, ensure_model, load_policy, warm_up
    from rollpatch.demo.task import DigitTask

    skill = {}
    # one thread, as the demo's trainer warms up (trainer.train: the islands' bits); torch's
    # default pool of one thread per core spins against every other process on a busy CI
    # machine (the warm-ups: 12-20 s of CPU at load 7 against 0.9 s on one thread)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for regime in ("fast", "real"):
            cfg = DemoConfig(out=str(tmp_path), regime=regime)
            torch.manual_seed(0)
            model, tok = load_policy(ensure_model(cfg, tmp_path / "model"))
            task = DigitTask.from_tokenizer(tok)
            assert warm_up(model, task, cfg) > 0.9  # both answer with a digit
            with torch.no_grad():
                lp = _last_logprobs(model, [task.prompt(d) for d in range(10)])
            skill[regime] = float(np.mean([lp[d, task.answer(d)].exp() for d in range(10)]))
    finally:
        torch.set_num_threads(threads)
    assert skill["fast"] < 0.2 and 0.3 < skill["real"] < 0.7, skill
