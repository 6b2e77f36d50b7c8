"""The demo's trainer process: ``python -m rollpatch.demo.trainer --config JSON --out DIR``.

Makes the tiny model, warms up its answer format, publishes version 0, then (once the
orchestrator says ``go`` with the gateway's URL) runs asynchronous GRPO: rollout workers fill a
bounded buffer through the gateway while the trainer takes complete groups, drops those more
than ``max_lag`` versions stale, takes one AdamW step on the rest (importance-weighted against
the behaviour version) and publishes a version after every step. At the end it re-generates
the rollouts under their labelled versions (:mod:`.verify`). Progress goes to stdout as events.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..board import Board
from ..publisher import Publisher, PublisherConfig
from ..trust import Signer
from .config import RUN, DemoConfig
from .events import emit, watch_parent
from .grpo import Rollout, split_by_lag
from .layout import Layout

__all__ = ["main"]


class _Published:
    """Turns the publisher's per-version stats into ``published`` events (with wall times),
    from a watcher thread, as soon as each version is durable and named by LATEST."""

    def __init__(self, pub: Publisher) -> None:
        self.pub = pub
        self.called_at: dict[int, float] = {}
        self._seen = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="demo-published", daemon=True)
        self._thread.start()

    def publish(self, state: Any) -> int:
        with self._lock:  # the watcher must not see a version before its call time
            t = time.time()
            v = self.pub.publish(state)
            self.called_at[v] = t
        return v

    def report(self) -> None:
        """Emit events for versions published since the last report."""
        with self._lock:
            stats = self.pub.stats
            for s in stats.versions[self._seen :]:
                emit(
                    "published",
                    version=s.version,
                    t_latest=self.called_at[s.version] + s.total_s,
                    bytes=s.bytes,
                    patch_bytes=s.patch_bytes,
                    changed=s.changed,
                    keyframe=s.keyframe,
                    skip_bases=list(s.skip_bases),
                    publish_s=s.total_s,
                )
            self._seen = len(stats.versions)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.report()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.report()


def _wait_command(commands: queue.Queue[dict[str, Any]], want: str) -> dict[str, Any]:
    while True:
        cmd = commands.get()
        if cmd.get("cmd") == want:
            return cmd
        if cmd.get("cmd") == "stop":
            raise SystemExit(0)


def _take_batch(
    pool: Any, cfg: DemoConfig, current: int
) -> tuple[list[Sequence[Rollout]], int, Counter[int], Counter[int]]:
    """``prompts_per_step`` fresh-enough groups; stale ones are dropped and replaced."""
    kept: list[Sequence[Rollout]] = []
    used: Counter[int] = Counter()
    dropped: Counter[int] = Counter()
    taken = 0
    while len(kept) < cfg.prompts_per_step:
        group = pool.take()
        taken += 1
        k, _, u, d = split_by_lag([group], current, cfg.max_lag)
        kept += k
        used += u
        dropped += d
    return kept, taken, used, dropped


def train(cfg: DemoConfig, layout: Layout, commands: queue.Queue[dict[str, Any]]) -> int:
    """The whole trainer run (see the module docstring); returns an exit status."""
    import torch

    from ..formats import cast_view
    from ..publisher import snapshot_state
    from .policy import ensure_model, grpo_step, load_policy, served_state, warm_up
    from .rollout import RolloutPool
    from .task import DigitTask
    from .verify import pick_sample, verify_rollouts

    torch.set_num_threads(1)  # the islands' kernels are single-threaded too: same bits
    torch.manual_seed(cfg.seed)
    t0 = time.monotonic()
    ensure_model(cfg, layout.model)
    model, tok = load_policy(layout.model)
    task = DigitTask.from_tokenizer(tok)
    digit_mass = warm_up(model, task, cfg)
    full = cast_view(snapshot_state(served_state(model)), cfg.format)
    signer = Signer.from_files([layout.key]) if cfg.sign else None
    pub = Publisher(
        layout.board_uri,
        RUN,
        PublisherConfig(format=cfg.format, max_pending=100_000, signer=signer),
    )
    published = _Published(pub)
    published.publish(served_state(model))
    pub.flush()
    published.report()
    emit(
        "ready",
        model_dir=str(layout.model),
        full_view_bytes=full.nbytes,
        n_elements=sum(t.n_elements for t in full.values()),
        digit_mass=digit_mass,
        params=sum(p.numel() for p in model.parameters()),
        setup_s=time.monotonic() - t0,
    )
    go = _wait_command(commands, "go")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.rl_lr)  # PyTorch defaults otherwise
    pool = RolloutPool(go["gateway"], task, cfg)
    pool.start()
    t_train = time.monotonic()
    try:
        for step in range(1, cfg.steps + 1):
            current = step - 1  # the trainer's weights are version step - 1
            t_step = time.monotonic()
            groups, taken, used, dropped = _take_batch(pool, cfg, current)
            t_wait = time.monotonic() - t_step
            stats = grpo_step(model, opt, groups, cfg.clip)
            version = published.publish(served_state(model))
            rewards = [r.reward for g in groups for r in g]
            islands = Counter(r.island for g in groups for r in g)
            # a version already durable is announced before its step: an island may commit it
            # within milliseconds, and the step line shows how long that took (its t_latest)
            published.report()
            emit(
                "step",
                step=step,
                version=version,
                reward=sum(rewards) / len(rewards),
                used_by_lag=dict(used),
                dropped_by_lag=dict(dropped),
                groups_taken=taken,
                islands=dict(islands),
                wait_s=t_wait,
                step_s=time.monotonic() - t_step,
                refusals=pool.refusals,
                **stats,
            )
            if not commands.empty() and commands.get().get("cmd") == "stop":
                return 130
    finally:
        pool.stop()
    pub.flush()
    published.close()
    served: dict[str, dict[str, int]] = {}
    for (island, v), n in sorted(pool.served.items()):
        served.setdefault(island, {})[str(v)] = n
    emit(
        "trained",
        latest=pub.last_durable,
        train_s=time.monotonic() - t_train,
        rollouts=len(pool.rollouts),
        served=served,
        dropped_versions=pub.stats.n_dropped,
    )
    t_verify = time.monotonic()
    if cfg.engine == "reference":
        sample = pick_sample(pool.rollouts, cfg.verify_samples)
        dtype = "bfloat16" if cfg.format == "bf16" else "float16"
        report = verify_rollouts(layout.model, Board(layout.board_uri), RUN, sample, dtype=dtype)
        if cfg.model == "moe":  # before "verified": the orchestrator stops reading there
            _check_routing(layout, pool.rollouts)
        emit(
            "verified",
            of=len(pool.rollouts),
            verify_s=time.monotonic() - t_verify,
            **report.to_json(),
        )
    else:
        emit(
            "verified",
            skipped=f"engine {cfg.engine}: its kernels are not the reference "
            "runtime's, so outputs cannot be compared bit for bit",
        )
    pub.close()
    return 0


def _check_routing(layout: Layout, rollouts: Sequence[Rollout]) -> None:
    """MoE: the routing every response carried, and a sample replayed by transformers."""
    from .routing import REPLAY_SAMPLES, check_routing, pick_spread
    from .verify import ViewHistory

    t0 = time.monotonic()
    report = check_routing(
        layout.model,
        ViewHistory(Board(layout.board_uri), RUN),
        rollouts,
        pick_spread(rollouts, REPLAY_SAMPLES),
        layout.replay,
    )
    emit("routing", check_s=time.monotonic() - t0, **report.to_json())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollpatch.demo.trainer")
    p.add_argument("--config", required=True, help="DemoConfig as JSON")
    p.add_argument("--out", required=True, help="the demo's output directory")
    args = p.parse_args(argv)
    cfg = DemoConfig.from_json(args.config)
    commands: queue.Queue[dict[str, Any]] = queue.Queue()
    watch_parent(commands.put, lambda: os._exit(3))  # orphaned: leave at once
    try:
        status = train(cfg, Layout(Path(args.out)), commands)
    except SystemExit as e:
        return int(e.code or 0)
    except BaseException as e:
        emit("error", where="trainer", message=f"{type(e).__name__}: {e}")
        raise
    emit("done", status=status)
    return status


if __name__ == "__main__":
    sys.exit(main())
