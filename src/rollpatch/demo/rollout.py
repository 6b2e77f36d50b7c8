"""Rollout workers: generate GRPO groups through the gateway, tagged with their versions.

Worker threads each build one group at a time (one prompt, G requests with their own sampling
seeds, sent concurrently) and put finished groups into a bounded buffer that the trainer
drains. The bound is what keeps rollouts fresh: when the trainer is slower than generation,
workers block instead of piling up stale groups. Every request carries the staleness bound
``rollpatch: {max_lag: K}``; every answer carries the versions that produced it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import RollpatchError
from .config import DemoConfig
from .grpo import Rollout
from .task import DigitTask

__all__ = ["RolloutError", "RolloutPool", "request_seed"]

#: How long one rollout may keep being refused (every island 409/503) before the demo fails.
_GIVE_UP_S = 120.0
#: How long a sidecar may wait for its engine to catch up before answering 409.
_WAIT_S = 1.0


class RolloutError(RollpatchError):
    """A rollout could not be produced or its answer was malformed."""


def request_seed(seed: int, group: int, member: int) -> int:
    """A distinct, reproducible 63-bit sampling seed per request."""
    words = np.random.SeedSequence([seed, group, member]).generate_state(2, np.uint32)
    return (int(words[0]) << 31 | int(words[1])) & ((1 << 63) - 1)


@dataclass(frozen=True)
class _Answer:
    token: int
    logprob: float
    version_start: int
    version_end: int
    island: str
    routed_experts: str | None
    spans: tuple[tuple[int, int, int], ...]


def _parse(body: Any, island_header: str | None) -> _Answer:
    """What the trainer keeps of a completions answer (routing too, for MoE models)."""
    try:
        choice = body["choices"][0]
        rp = body["rollpatch"]
        routed = choice.get("routed_experts")
        return _Answer(
            token=int(choice["token_ids"][0]),
            logprob=float(choice["logprobs"]["token_logprobs"][0]),
            version_start=int(rp["version_start"]),
            version_end=int(rp["version_end"]),
            island=str(rp.get("island") or island_header),
            routed_experts=None if routed is None else str(routed),
            spans=tuple(
                (int(s["start"]), int(s["end"]), int(s["version"])) for s in rp.get("spans") or ()
            ),
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise RolloutError("malformed completion from the gateway", error=repr(e)) from None


class RolloutPool:
    """Background generation of groups into a buffer of ``prompts_per_step`` groups."""

    def __init__(self, gateway_url: str, task: DigitTask, cfg: DemoConfig) -> None:
        import httpx

        self.cfg = cfg
        self.task = task
        self.buffer: queue.Queue[list[Rollout]] = queue.Queue(maxsize=cfg.prompts_per_step)
        self.rollouts: list[Rollout] = []
        self.served: Counter[tuple[str, int]] = Counter()  # (island, version) -> answers
        self.refusals = 0
        self._client = httpx.Client(
            base_url=gateway_url,
            timeout=httpx.Timeout(60.0),
            limits=httpx.Limits(max_connections=cfg.concurrency + 4),
        )
        self._requests = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="rollout-req")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_group = 0
        self._error: BaseException | None = None
        n_workers = max(2, -(-cfg.concurrency // cfg.group_size) + 1)
        self._workers = [
            threading.Thread(target=self._work, name=f"rollout-{i}", daemon=True)
            for i in range(n_workers)
        ]

    def start(self) -> None:
        """Start the worker threads."""
        for t in self._workers:
            t.start()

    def stop(self) -> None:
        """Stop generating; requests in flight finish (their groups are discarded)."""
        self._stop.set()
        for t in self._workers:
            t.join(timeout=_GIVE_UP_S)
        self._requests.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def take(self, timeout: float = 300.0) -> list[Rollout]:
        """The next finished group (blocks); raises the workers' error if they failed."""
        deadline = time.monotonic() + timeout
        while True:
            if self._error is not None:
                raise self._error
            try:
                return self.buffer.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RolloutError("no rollouts arrived in time", timeout_s=timeout) from None

    # -- workers -------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                group = self._group()
                if group is None:
                    return
                with self._lock:
                    self.rollouts.extend(group)
                    self.served.update((r.island, r.version) for r in group)
                while not self._stop.is_set():
                    try:
                        self.buffer.put(group, timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 (handed to the trainer by take())
            self._error = e

    def _group(self) -> list[Rollout] | None:
        with self._lock:
            gid = self._next_group
            self._next_group += 1
        rng = np.random.default_rng([self.cfg.seed, gid])
        digit = self.task.sample(rng)
        prompt = tuple(self.task.prompt(digit))
        futures = [
            self._requests.submit(self._one, gid, digit, prompt, m)
            for m in range(self.cfg.group_size)
        ]
        results = [f.result() for f in futures]
        if any(r is None for r in results):
            return None  # stopping
        return [r for r in results if r is not None]

    def _one(self, gid: int, digit: int, prompt: tuple[int, ...], member: int) -> Rollout | None:
        seed = request_seed(self.cfg.seed, gid, member)
        body = {
            "prompt": list(prompt),
            "max_tokens": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
            "rollpatch": {"max_lag": self.cfg.max_lag, "wait_s": _WAIT_S},
        }
        deadline = time.monotonic() + _GIVE_UP_S
        while not self._stop.is_set():
            r = self._client.post("/v1/completions", json=body)
            if r.status_code == 200:
                a = _parse(r.json(), r.headers.get("x-rollpatch-island"))
                return Rollout(
                    group=gid,
                    digit=digit,
                    prompt=prompt,
                    seed=seed,
                    token=a.token,
                    logprob=a.logprob,
                    version_start=a.version_start,
                    version_end=a.version_end,
                    island=a.island,
                    reward=self.task.reward(digit, a.token),
                    routed_experts=a.routed_experts,
                    spans=a.spans,
                )
            if r.status_code not in (409, 503) or time.monotonic() > deadline:
                raise RolloutError(
                    "the gateway refused a rollout", status=r.status_code, body=r.text[:300]
                )
            with self._lock:
                self.refusals += 1
            time.sleep(0.1)
        return None
