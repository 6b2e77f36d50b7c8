"""The demo's label check (rollpatch.demo.verify): every rollout is sampled again under its
labelled version, and must give the same token and logprob, bit for bit.

The check runs one forward pass per distinct prompt and version (a GRPO group asks one prompt
with G seeds) and samples each rollout from those logits with its own seed. That must be
exactly what the engine's own ``generate`` gives for each rollout, on a dense and on an MoE
model, and a rollout that does not match its label must still be caught.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the reference extra installs transformers")

import torch

from rollpatch.board import Board
from rollpatch.demo.config import RUN, DemoConfig
from rollpatch.demo.grpo import Rollout
from rollpatch.demo.policy import ensure_model, load_policy, served_state
from rollpatch.demo.rollout import request_seed
from rollpatch.demo.task import DigitTask
from rollpatch.demo.verify import Regenerator, ViewHistory, regenerate, verify_rollouts
from rollpatch.engines.reference import ReferenceRuntime
from rollpatch.publisher import Publisher, PublisherConfig

VERSIONS, PER_VERSION = 3, 24


@pytest.fixture(scope="module", params=["dense", "moe"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny policy, VERSIONS published versions that move every weight, and rollouts
    sampled under each version by the engine's own ``generate`` (as the islands serve them)."""
    root = tmp_path_factory.mktemp(f"verify-{request.param}")
    torch.manual_seed(0)
    cfg = DemoConfig(model=request.param, hidden=64, out=str(root))
    model_dir = ensure_model(cfg, root / "model")
    model, tok = load_policy(model_dir)
    task = DigitTask.from_tokenizer(tok)
    board = Board((root / "board").as_uri())
    pub = Publisher(board.store.uri, RUN, PublisherConfig(max_pending=100))
    with torch.no_grad():
        for v in range(VERSIONS):
            for p in model.parameters() if v else ():
                p.add_(torch.randn_like(p) * 2e-2)
            pub.publish(served_state(model))
        pub.flush()
    pub.close()
    runtime = ReferenceRuntime(model_dir, dtype="bfloat16", threads=1)
    history = ViewHistory(board, RUN)
    rng = np.random.default_rng(0)
    rollouts = []
    for v in range(VERSIONS):
        runtime.load_view(history.get(v), v)
        for i in range(PER_VERSION):
            digit, group = int(rng.integers(4)), v * 100 + i // 4
            r = Rollout(
                group=group,
                digit=digit,
                prompt=tuple(task.prompt(digit)),
                seed=request_seed(0, group, i % 4),
                token=0,
                logprob=0.0,
                version_start=v,
                version_end=v,
                island="local",
                reward=0.0,
            )
            token, logprob = regenerate(runtime, r)
            assert logprob is not None
            rollouts.append(dataclasses.replace(r, token=token, logprob=logprob))
    return model_dir, board, runtime, history, rollouts


def test_one_forward_per_prompt_samples_what_generate_samples(run: Any) -> None:
    _, _, runtime, history, rollouts = run
    for v in range(VERSIONS):
        runtime.load_view(history.get(v), v)
        regen = Regenerator(runtime)
        mine = [r for r in rollouts if r.version == v]
        for r in mine:
            assert regen.sample(r) == regenerate(runtime, r) == (r.token, r.logprob)
        assert regen.forwards == len({r.prompt for r in mine}) < len(mine)
    assert len({r.token for r in rollouts}) > 1  # sampled, not one greedy answer


def test_the_label_check_passes_labelled_rollouts_and_catches_the_others(run: Any) -> None:
    model_dir, board, _, _, rollouts = run
    report = verify_rollouts(model_dir, board, RUN, rollouts)
    assert (report.checked, report.mismatches, report.versions) == (len(rollouts), [], VERSIONS)
    assert report.controls == VERSIONS - 1 and report.controls_differ == VERSIONS - 1
    last = rollouts[-1]
    relabelled = dataclasses.replace(last, version_start=0, version_end=0)  # wrong version
    other = next(t for t in range(8) if t != last.token)
    wrong_token = dataclasses.replace(last, token=other)
    wrong_logprob = dataclasses.replace(last, logprob=np.nextafter(last.logprob, 0.0))
    bad = [relabelled, wrong_token, wrong_logprob]
    report = verify_rollouts(model_dir, board, RUN, [*rollouts, *bad])
    assert report.checked == len(rollouts) + len(bad)
    assert [m["problem"] for m in report.mismatches] == ["differs from its labelled version"] * 3
    assert {(m["version"], m["token"]) for m in report.mismatches} == {
        (0, last.token),
        (last.version, other),
        (last.version, last.token),
    }
