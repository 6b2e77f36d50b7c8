"""The label check: does each rollout's version label match the weights that produced it?

For a rollout labelled version ``v`` (``version_start == version_end``: drain commits), the
trainer rebuilds version ``v``'s served view from the board (a keyframe plus verified patches,
:mod:`rollpatch.publisher.reconstruct`), loads it into its own
:class:`~rollpatch.engines.reference.ReferenceRuntime`, and regenerates the rollout with the
same prompt, seed and sampling parameters. Token id and logprob must be *exactly* equal (same
bits, same code, same single-threaded CPU kernels). As a control that the check can fail, a
few rollouts are also regenerated under version ``v - 1``: their logprobs must differ.

A version's rollouts share a few prompts (GRPO asks each prompt G times), so the forward pass
runs once per distinct prompt and version, and each rollout is sampled from those logits with
its own seed by the engine's sampler (:class:`Regenerator`; tests/test_demo_verify.py holds it
equal to ``generate``, rollout by rollout).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..board import Board
from ..publisher import apply_step, reconstruct
from ..view import View
from .grpo import Rollout

if TYPE_CHECKING:
    from ..engines.reference import ReferenceRuntime

__all__ = [
    "Regenerator",
    "VerifyReport",
    "ViewHistory",
    "pick_sample",
    "regenerate",
    "verify_rollouts",
]

#: Rollouts regenerated under the previous version, as the check's negative control.
_CONTROLS = 16


class ViewHistory:
    """Served views of a run's versions, rebuilt from the board and walked forward."""

    def __init__(self, board: Board, run: str) -> None:
        self.board = board
        self.run = run
        self._views: dict[int, View] = {}

    def get(self, version: int) -> View:
        """Version ``version``'s view (cached); built from the nearest older cached one."""
        view = self._views.get(version)
        if view is not None:
            return view
        older = [v for v in self._views if v < version]
        if not older:
            view = reconstruct(self.board, self.run, version)
        else:
            base = max(older)
            view = self._views[base].copy()
            for step in self.board.plan(self.run, base, version).steps:
                view = apply_step(self.board, self.run, step, view)
        self._views[version] = view
        return view


@dataclass
class VerifyReport:
    """What the label check found."""

    checked: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    by_island: dict[str, int] = field(default_factory=dict)
    versions: int = 0
    controls: int = 0
    controls_differ: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "mismatches": len(self.mismatches),
            "first_mismatches": self.mismatches[:5],
            "checked_by_island": self.by_island,
            "versions_checked": self.versions,
            "control_rollouts": self.controls,
            "control_detected": self.controls_differ,
        }


def pick_sample(rollouts: Sequence[Rollout], limit: int) -> list[Rollout]:
    """All rollouts (``limit`` 0), else up to ``limit`` spread over (island, version)."""
    if limit <= 0 or limit >= len(rollouts):
        return list(rollouts)
    buckets: dict[tuple[str, int], list[Rollout]] = defaultdict(list)
    for r in rollouts:
        buckets[(r.island, r.version)].append(r)
    out: list[Rollout] = []
    depth = 0
    while len(out) < limit:
        added = False
        for key in sorted(buckets):
            if depth < len(buckets[key]) and len(out) < limit:
                out.append(buckets[key][depth])
                added = True
        if not added:
            break
        depth += 1
    return out


def verify_rollouts(
    model_dir: str | Path,
    board: Board,
    run: str,
    rollouts: Sequence[Rollout],
    *,
    dtype: str = "bfloat16",
) -> VerifyReport:
    """Regenerate ``rollouts`` under their labelled versions; report every difference."""
    from ..engines.reference import ReferenceRuntime

    runtime = ReferenceRuntime(model_dir, dtype=dtype, threads=1)
    history = ViewHistory(board, run)
    report = VerifyReport()
    by_version: dict[int, list[Rollout]] = defaultdict(list)
    for r in rollouts:
        if r.version_start != r.version_end:
            report.mismatches.append(_describe(r, "response spans two versions", None))
            continue
        by_version[r.version].append(r)
    for v in sorted(by_version):
        runtime.load_view(history.get(v), v)
        regen = Regenerator(runtime)
        for r in by_version[v]:
            token, logprob = regen.sample(r)
            report.checked += 1
            report.by_island[r.island] = report.by_island.get(r.island, 0) + 1
            if token != r.token or logprob != r.logprob:
                report.mismatches.append(
                    _describe(r, "differs from its labelled version", (token, logprob))
                )
    report.versions = len(by_version)
    controls = [r for v in sorted(by_version) if v > 0 for r in by_version[v][:1]][-_CONTROLS:]
    for r in controls:
        runtime.load_view(history.get(r.version - 1), r.version - 1)
        token, logprob = Regenerator(runtime).sample(r)
        report.controls += 1
        report.controls_differ += int(token != r.token or logprob != r.logprob)
    return report


class Regenerator:
    """A rollout's one-token answer again, as the engine sampled it, under the runtime's
    loaded version.

    A GRPO group asks one prompt G times with G seeds, and the demo's task has ten prompts, so
    a version's rollouts share a handful of prompts. The forward pass (the dear part: an MoE
    forward on one thread) is the same for each sample of a prompt, so it runs once per
    prompt here, batch 1 and single-threaded like the islands' (the same bits), and each
    rollout is sampled from those logits with its own seed by the engine's own sampler
    (:func:`~rollpatch.engines.reference.generation.pick_token`, as ``generate`` calls it).
    Make a new one after each ``load_view``. The logits come from
    :meth:`~rollpatch.engines.reference.ReferenceRuntime.next_logits`.
    """

    def __init__(self, runtime: ReferenceRuntime) -> None:
        self.runtime = runtime
        self._logits: dict[tuple[int, ...], Any] = {}
        self.forwards = 0

    def logits(self, prompt: tuple[int, ...]) -> Any:
        """The last position's logits after ``prompt`` (one forward per distinct prompt)."""
        out = self._logits.get(prompt)
        if out is None:
            out, _ = self.runtime.next_logits(prompt)
            self._logits[prompt] = out
            self.forwards += 1
        return out

    def sample(self, r: Rollout) -> tuple[int, float | None]:
        """``r``'s token and logprob: what ``generate(prompt, max_tokens=1, temperature=1,
        top_p=1, seed=r.seed, logprobs=0)`` gives under the loaded version."""
        import torch

        from ..engines.reference.generation import pick_token

        gen = torch.Generator()
        gen.manual_seed(r.seed % (1 << 64))
        step = pick_token(self.logits(r.prompt), 1.0, 1.0, gen, 0)
        return step.token_id, step.logprob


def regenerate(runtime: Any, r: Rollout) -> tuple[int, float | None]:
    """``r`` regenerated through the runtime's own ``generate`` (one forward per rollout): the
    reference that :class:`Regenerator` must equal (tests)."""
    gen = runtime.generate(
        list(r.prompt), max_tokens=1, temperature=1.0, top_p=1.0, seed=r.seed, logprobs=0
    )
    try:
        step = next(gen)
    finally:
        gen.close()
    return step.token_id, step.logprob


def _describe(r: Rollout, what: str, got: tuple[int, float | None] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "problem": what,
        "island": r.island,
        "version": r.version,
        "versions": [r.version_start, r.version_end],
        "seed": r.seed,
        "token": r.token,
        "logprob": r.logprob,
    }
    if got is not None:
        out.update(regenerated_token=got[0], regenerated_logprob=got[1])
    return out
