"""The reference engine tests' world: the tiny model served by one :class:`ReferenceEngine`
per test module (booted on version 1), ``base`` (its boot weights) and ``target`` (version 2,
~5% of values moved), ``restore`` (back on version 1 after a test that commits), an
``openai`` client, and :func:`greedy`. The test_reference_engine*.py modules import its
fixtures by name; they skip when torch, transformers or fastapi are missing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from rollpatch.io.safetensors import save_view
from rollpatch.view import Tensor, View

PROMPT = "What is 12 + 7? The answer is"


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    import torch

    from rollpatch.engines.reference import ReferenceEngine

    threads = torch.get_num_threads()
    eng = ReferenceEngine.from_dir(model_dir, threads=1)  # fastest for a tiny model
    eng.load(eng.runtime.view.copy(), 1)
    yield eng
    eng.close()
    torch.set_num_threads(threads)  # the setting is process-wide


@pytest.fixture(scope="module")
def base(engine: Any) -> View:
    """A private copy of the boot weights (version 1)."""
    return engine.runtime.view.copy()


@pytest.fixture(scope="module")
def target(base: View) -> View:
    """Version 2: ~5% of every tensor's values moved by a few percent, re-rounded to BF16."""
    rng = np.random.default_rng(7)
    out = base.copy()
    for name in out:
        t = out[name]
        vals = t.data.view(ml_dtypes.bfloat16).astype(np.float32)
        pick = rng.random(vals.size) < 0.05
        vals[pick] *= 1 + rng.normal(0, 0.2, int(pick.sum())).astype(np.float32)
        out[name] = Tensor(t.kind, t.shape, vals.astype(ml_dtypes.bfloat16).view(np.uint16))
    return out


@pytest.fixture(scope="module")
def target_dir(model_dir: Path, target: View, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding the target weights (a keyframe is a loadable checkpoint)."""
    out = tmp_path_factory.mktemp("target") / "tiny"
    shutil.copytree(model_dir, out)
    save_view(target, out / "model.safetensors", {"format": "pt"})
    return out


@pytest.fixture()
def restore(engine: Any, base: View) -> Iterator[None]:
    """Put the engine back on version 1 after a test that commits."""
    yield
    engine.runtime.step_hook = None
    engine.resume()
    engine.load(base, 1)


@pytest.fixture(scope="module")
def client(engine: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0, timeout=60)


def greedy(runtime: Any, n: int = 24) -> list[tuple[int, float | None, Any]]:
    """The first ``n`` greedy tokens after :data:`PROMPT`: ids, logprobs, top-3 logprobs."""
    ids = runtime.tokenizer.encode(PROMPT)
    gen = runtime.generate(ids, max_tokens=n, temperature=0, logprobs=3, ignore_eos=True)
    return [(s.token_id, s.logprob, s.top_logprobs) for s in gen]


def audited_sidecar(board: str, eng: Any) -> tuple[Any, int]:
    """Three versions of ``eng``'s own weights (each step 1 % larger) published on ``board``,
    and a sidecar over ``eng`` in pause mode that audits every 0.05 s at 64 MiB a period:
    (the started sidecar, the newest version). The caller stops the sidecar."""
    from rollpatch.follower import FollowerConfig
    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    masters = {n: t.to_array().astype(np.float32) for n, t in eng.runtime.view.items()}
    with Publisher(board, "r1", PublisherConfig(keyframe_every=4), asynchronous=False) as pub:
        for step in range(3):
            if step:
                for m in masters.values():
                    m *= np.float32(1.01)
            latest = pub.publish(masters)
    period = 0.05
    cfg = SidecarConfig(
        commit_mode="pause",
        follower=FollowerConfig(
            poll_s=0.05, audit_bytes_per_s=64 * 2**20 / period, audit_period_s=period
        ),
    )
    return start_sidecar(board, "r1", eng, eng.url, config=cfg), latest
