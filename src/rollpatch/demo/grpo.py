"""GRPO-style policy-gradient math, kept pure so it can be tested on its own.

- Advantages are group-relative: ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``
  (a group whose rewards are all equal teaches nothing: its advantages are 0).
- Rollouts come from the *behaviour* policy (the served version ``v`` that produced them, in
  BF16 on an engine), while the trainer updates the *current* policy (its FP32 master, version
  ``n >= v``). Each token is weighted by the importance ratio
  ``rho = pi_current(a|x) / pi_behaviour(a|x)``, computed from the logprob the engine reported
  and the trainer's own logprob, and the PPO-clipped surrogate
  ``min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)`` is maximised.
- Bounded staleness: a group whose oldest rollout is more than ``max_lag`` versions behind the
  current policy is dropped, not weighted (:func:`split_by_lag`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Rollout", "clipped_surrogate", "group_advantages", "importance_ratio", "split_by_lag"]


@dataclass(frozen=True)
class Rollout:
    """One sampled answer and the versions that produced it."""

    group: int
    digit: int
    prompt: tuple[int, ...]
    seed: int
    token: int
    logprob: float
    """The engine's raw logprob of ``token`` under the behaviour version."""
    version_start: int
    version_end: int
    island: str
    reward: float
    routed_experts: str | None = None
    """MoE models: the response's ``routed_experts`` as it arrived (base64 of a ``.npy``
    ``[tokens, layers, top_k]`` array, docs/moe.md); None for dense models."""
    spans: tuple[tuple[int, int, int], ...] = ()
    """MoE models: the response's ``rollpatch.spans`` as ``(start, end, version)`` rows."""

    @property
    def version(self) -> int:
        """The behaviour version (drain commits: start == end)."""
        return self.version_start


def group_advantages(
    rewards: Sequence[float] | np.ndarray, *, eps: float = 1e-4, normalize: bool = True
) -> np.ndarray:
    """Group-relative advantages: reward minus the group mean, divided by the group std.

    ``std`` is the unbiased sample std (as GRPO implementations use); with ``normalize`` off
    only the mean is subtracted (Dr. GRPO).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size < 2:
        raise ValueError("a group needs at least two rewards")
    adv = r - r.mean()
    if normalize:
        adv = adv / (r.std(ddof=1) + eps)
    return adv


def importance_ratio(logp_current: Any, logp_behaviour: Any) -> Any:
    """``exp(logp_current - logp_behaviour)`` (numpy arrays or torch tensors)."""
    diff = logp_current - logp_behaviour
    if isinstance(diff, np.ndarray):
        return np.exp(diff)
    return diff.exp()


def clipped_surrogate(
    logp_current: Any, logp_behaviour: Any, advantages: Any, clip: float
) -> tuple[Any, dict[str, float]]:
    """The loss to minimise, ``-mean(min(rho * A, clip(rho) * A))``, and diagnostics.

    Works on torch tensors (differentiable through ``logp_current``) and on numpy arrays.
    Diagnostics: mean ratio, fraction of tokens whose ratio was clipped where it mattered.
    """
    rho = importance_ratio(logp_current, logp_behaviour)
    if isinstance(rho, np.ndarray):
        clipped = np.clip(rho, 1 - clip, 1 + clip)
        surrogate = np.minimum(rho * advantages, clipped * advantages)
        loss = -surrogate.mean()
        active = (rho * advantages) > (clipped * advantages)
        return loss, {"ratio_mean": float(rho.mean()), "clip_frac": float(active.mean())}
    clipped = rho.clamp(1 - clip, 1 + clip)
    unclipped_obj = rho * advantages
    clipped_obj = clipped * advantages
    loss = -(unclipped_obj.minimum(clipped_obj)).mean()
    with_grad_off = (unclipped_obj > clipped_obj).float().mean()
    return loss, {
        "ratio_mean": float(rho.detach().mean()),
        "clip_frac": float(with_grad_off.detach()),
    }


def split_by_lag(
    groups: Sequence[Sequence[Rollout]], current: int, max_lag: int
) -> tuple[list[Sequence[Rollout]], list[Sequence[Rollout]], Counter[int], Counter[int]]:
    """Keep groups whose every rollout is at most ``max_lag`` versions behind ``current``.

    Returns (kept groups, dropped groups, rollouts used per lag, rollouts dropped per lag).
    A whole group is kept or dropped, so advantages are always taken over complete groups.
    """
    kept: list[Sequence[Rollout]] = []
    dropped: list[Sequence[Rollout]] = []
    used_lags: Counter[int] = Counter()
    dropped_lags: Counter[int] = Counter()
    for g in groups:
        lags = [current - r.version for r in g]
        if max(lags) > max_lag:
            dropped.append(g)
            dropped_lags.update(lags)
        else:
            kept.append(g)
            used_lags.update(lags)
    return kept, dropped, used_lags, dropped_lags
