"""Tests of ``rollpatch demo``: the link emulator, the GRPO math, and a tiny run end to end.

The end-to-end run starts real processes (trainer, relays, three islands) on loopback and
checks the JSON report the demo writes; the other tests are pure and fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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
from rollpatch.errors import ConfigError, NotFoundError
from rollpatch.store import MemoryStore, ThrottledStore
from rollpatch.store.throttle import FairLink


class FakeClock:
    """``clock``/``sleep`` pair: sleeping advances time (unless ``frozen``) and is recorded."""

    def __init__(self, frozen: bool = False) -> None:
        self.now = 0.0
        self.frozen = frozen
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        if not self.frozen:
            self.now += seconds


def _throttled(
    name: str, bps: float | None, latency: float, clock: FakeClock
) -> tuple[MemoryStore, ThrottledStore]:
    MemoryStore.reset(name)
    inner = MemoryStore(name)
    return inner, ThrottledStore(inner, bps, latency, clock=clock.clock, sleep=clock.sleep)


# -- ThrottledStore ------------------------------------------------------------------------------


def test_throttle_latency_only() -> None:
    clock = FakeClock()
    inner, link = _throttled("thr-lat", None, 0.25, clock)
    inner.put("a/b", b"x" * 1000)
    assert link.get("a/b") == b"x" * 1000
    assert clock.slept == [pytest.approx(0.25)]
    s = link.stats
    assert (s.calls, s.bytes_down, s.bytes_up) == (1, 1000, 0)
    assert s.delay_s == pytest.approx(0.25)


def test_throttle_bandwidth_adds_transfer_time() -> None:
    clock = FakeClock()
    inner, link = _throttled("thr-bw", 8e6, 0.05, clock)  # 8 Mbit/s = 1 MB/s
    inner.put("obj", bytes(1_000_000))
    link.get("obj")
    assert clock.now == pytest.approx(0.05 + 1.0)
    assert link.get_range("obj", 0, 500_000) == bytes(500_000)
    assert clock.now == pytest.approx(1.05 + 0.05 + 0.5)
    assert link.stats.bytes_down == 1_500_000


def test_fair_link_shares_bandwidth() -> None:
    link = FairLink(1e6)  # bytes per second
    link.add(1, 1e6, 0.0)
    link.add(2, 1e6, 0.0)
    assert link.eta(1) == pytest.approx(2.0)  # two equal transfers: each at half rate
    link.advance(2.0)
    assert link.done(1) and link.done(2)

    link.add(3, 1e6, 10.0)
    link.add(4, 1e6, 10.5)  # 3 has 0.5 MB left when 4 arrives
    assert link.eta(3) == pytest.approx(1.0)
    link.advance(11.5)
    assert link.done(3) and not link.done(4)
    assert link.eta(4) == pytest.approx(0.5)  # alone again: full rate

    link.add(5, 1e6, 20.0)
    link.add(6, 1_000, 20.1)  # a small read is not stuck behind a big one
    assert link.eta(6) == pytest.approx(0.002)
    link.advance(20.102)
    assert link.done(6) and not link.done(5)


def test_throttle_writes_lists_and_failures() -> None:
    clock = FakeClock()
    inner, link = _throttled("thr-misc", 8e6, 0.01, clock)
    link.put("k/1", bytes(100_000))  # 0.01 + 0.1 s
    assert inner.get("k/1") == bytes(100_000)
    assert link.list("k/") == ["k/1"]  # 4 bytes of keys: latency dominates
    with pytest.raises(NotFoundError):
        link.get("k/missing")  # a failure still pays its round trip
    assert link.head("k/1") is not None
    s = link.stats
    assert (s.calls, s.bytes_up, s.bytes_down) == (4, 100_000, 4)
    assert clock.now == pytest.approx(0.01 + 0.1 + (0.01 + 4 * 8 / 8e6) + 0.01 + 0.01)
    assert link.writable and link.uri == inner.uri


def test_throttle_real_clock_holds_at_least_the_latency() -> None:
    MemoryStore.reset("thr-real")
    inner = MemoryStore("thr-real")
    inner.put("x", b"1")
    link = ThrottledStore(inner, None, 0.02)
    t0 = time.monotonic()
    link.get("x")
    assert time.monotonic() - t0 >= 0.02  # a lower bound only: sleeps never end early


@pytest.mark.parametrize(
    "bps, latency", [(0, 0.1), (-1, 0.1), (1e6, -0.1), (float("nan"), 0.0), (True, 0.0)]
)
def test_throttle_rejects_bad_settings(bps: float, latency: float) -> None:
    with pytest.raises(ConfigError):
        ThrottledStore(MemoryStore("thr-bad"), bps, latency)


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
    for regime in ("fast", "real"):
        cfg = DemoConfig(out=str(tmp_path), regime=regime)
        torch.manual_seed(0)
        model, tok = load_policy(ensure_model(cfg, tmp_path / "model"))
        task = DigitTask.from_tokenizer(tok)
        assert warm_up(model, task, cfg) > 0.9  # both answer with a digit
        with torch.no_grad():
            lp = _last_logprobs(model, [task.prompt(d) for d in range(10)])
        skill[regime] = float(np.mean([lp[d, task.answer(d)].exp() for d in range(10)]))
    assert skill["fast"] < 0.2 and 0.3 < skill["real"] < 0.7, skill


# -- end to end --------------------------------------------------------------------------------


def _demo_argv(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollpatch",
        "demo",
        "--no-live",
        "--out",
        str(out),
        "--hidden",
        "64",
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
        "--wan-mbps",
        "20",
        "--wan-latency-ms",
        "50",
        *extra,
    ]


def _children_of(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            pids.append(int(entry.name))
    return pids


def test_demo_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "demo"
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        _demo_argv(out, "--steps", "4", "--json", str(report_path)),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(report_path.read_text())
    assert r["ok"] is True
    assert all(inv["ok"] is True for inv in r["invariants"].values()), r["invariants"]
    assert r["verification"]["checked"] > 0 and r["verification"]["mismatches"] == 0
    assert r["routing"] is None and "routing_replays" not in r["invariants"]  # dense model
    assert [v["version"] for v in r["versions"]] == [0, 1, 2, 3, 4]
    full = r["model"]["full_view_bytes"]
    for v in r["versions"][1:]:
        assert 0 < v["patch_bytes"] < full
    for name, island in r["islands"].items():
        assert island["answers"] >= 1, name
        assert island["final_version"] == 4 and island["versions_loaded"][-1] == 4
        assert island["bytes_fetched"] > 0
    for relay in r["relays"].values():
        assert relay["upstream_bytes"] > 0 and relay["refused"] == 0
        # the WAN is real TCP through rollpatch.netem: payload plus HTTP framing crossed it
        assert relay["link"]["connections"] > 0
        assert relay["link"]["bytes_down"] >= relay["upstream_bytes"]
    assert len(r["reward_curve"]) == 4
    assert sum(r["rollouts"]["used_by_lag"].values()) >= 4 * 32
    for png in ("reward", "versions", "bytes"):
        assert (out / f"{png}.png").stat().st_size > 0
    assert "EMULATED" in proc.stdout
    assert not _children_of(str(out)), "a demo process outlived the demo"
    # signed by default: every manifest is an envelope, and it verifies under the run's root
    from rollpatch.board import Board
    from rollpatch.trust import Trust

    assert r["config"]["sign"] is True
    board = Board((out / "board").as_uri(), trust=Trust((out / "trust" / "root.json").read_bytes()))
    assert all(board.signed("demo", n) for n in range(5))
    assert board.latest("demo").version == 4 and board.manifest("demo", 4).version == 4


def test_demo_moe_carries_and_replays_routing(tmp_path: Path) -> None:
    """``--model moe``: a tiny Qwen3-MoE trained, published and served; every response carried
    its routed experts, labelled, and transformers replays a sample under the labelled version."""
    pytest.importorskip("transformers")
    out = tmp_path / "demo-moe"
    report_path = tmp_path / "moe.json"
    argv = _demo_argv(out, "--model", "moe", "--steps", "2", "--json", str(report_path))
    argv[argv.index("--prompts-per-step") + 1] = "4"
    proc = subprocess.run(
        [*argv, "--verify-samples", "16"], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(report_path.read_text())
    assert r["ok"] is True and r["config"]["model"] == "moe"
    assert set(r["invariants"]) == {
        "labels_match_weights",
        "latest_only_advanced",
        "islands_on_latest",
        "fetched_bytes_verified",
        "routing_replays",
    }
    assert all(inv["ok"] is True for inv in r["invariants"].values()), r["invariants"]
    rt = r["routing"]
    assert rt["model"] == {"moe_layers": 2, "experts": 8, "top_k": 2}
    assert rt["responses"] == rt["with_routed_experts"] == r["rollouts"]["total"] > 0
    assert rt["problems"] == 0 and rt["replay_mismatches"] == 0
    assert rt["replayed"] >= 3 and rt["replayed_tokens"] >= 3 * rt["replayed"]
    assert sum(d["responses"] for d in rt["by_version"].values()) == rt["responses"]
    for shape, n in rt["shapes"].items():
        tokens, layers, k = map(int, shape.split("x"))
        assert tokens >= 2 and (layers, k) == (2, 2) and n > 0
    assert "routed_experts in" in proc.stdout and "[PASS] routing_replays" in proc.stdout
    assert not _children_of(str(out)), "a demo process outlived the demo"


@pytest.mark.slow
def test_demo_interrupt_stops_every_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "demo-int"
    proc = subprocess.Popen(
        _demo_argv(out, "--steps", "200"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # interrupt in the middle of training
            if line.startswith("step   2/"):
                break
        assert len(_children_of(str(out))) >= 5  # trainer, relays, three islands
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, rest
    assert "interrupted" in rest
    assert not _children_of(str(out))
