"""The sidecar tests' world: a board with published versions of the tiny model, the built-in
engine behind a running sidecar, and the real openai client (tests/test_sidecar*.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

import httpx
import openai

from rollpatch.engines.reference import ReferenceEngine, ReferenceRuntime
from rollpatch.follower import FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import RunningSidecar, start_sidecar

PROMPT = "12 + 7 ="
MAX_TOKENS = 6
MODEL = "model"  # the reference engine serves its directory name


class World:
    """A board with a run whose versions visibly change the model's greedy output."""

    def __init__(self, root: Path, model: Path) -> None:
        self.model = model
        self.oracle = ReferenceRuntime(self.model, threads=1)
        self.masters = {n: t.to_array().astype(np.float32) for n, t in self.oracle.view.items()}
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(
            self.board,
            "r1",
            PublisherConfig(keyframe_every=4, skip_strides=(2,)),
            asynchronous=False,
        )
        self.expected: dict[int, tuple[list[int], list[float]]] = {}
        self.rng = np.random.default_rng(1)
        self.lock = threading.Lock()
        self.prompt_ids = self.oracle.tokenizer(PROMPT)["input_ids"]
        self.publish()

    def publish(self) -> int:
        """Publish the next version (a visible weight change) and record its greedy output."""
        with self.lock:
            if self.expected:
                for m in self.masters.values():
                    if m.ndim == 2:
                        m += (0.01 * self.rng.standard_normal(m.shape)).astype(np.float32)
            view = cast_view(self.masters, "bf16")
            self.oracle.load_view(view)
            gen = self.oracle.generate(
                self.prompt_ids, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
            )
            steps = list(gen)
            v = self.publisher.publish(self.masters)
            self.publisher.flush()
            self.expected[v] = ([s.token_id for s in steps], [s.logprob for s in steps])
            return v

    def check(self, choice: Any, version: int) -> None:
        tokens, logprobs = self.expected[version]
        assert choice["token_ids"] == tokens, f"tokens are not those of version {version}"
        got = choice["logprobs"]["token_logprobs"]
        assert np.array_equal(np.array(got, dtype=np.float32), np.array(logprobs, np.float32))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> World:
    return World(tmp_path_factory.mktemp("sidecar"), tiny_model)


def _start(
    world: World, mode: str = "drain", token: str | None = None, run: str = "r1"
) -> RunningSidecar:
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    return start_sidecar(
        world.board,
        run,
        engine,
        engine.url,
        config=SidecarConfig(
            commit_mode=mode, admin_token=token, follower=FollowerConfig(poll_s=0.05)
        ),
    )


def _wait_ready(sc: RunningSidecar) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(f"{sc.url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "sidecar never became ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def sidecar(world: World) -> Any:
    sc = _start(world, token="s3cret")
    _wait_ready(sc)
    yield sc
    sc.stop()


def _client(sc: RunningSidecar) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sc.url}/v1", api_key="unused", max_retries=0)


def _complete(client: openai.OpenAI, **rollpatch: Any) -> tuple[dict[str, Any], dict[str, str]]:
    extra: dict[str, Any] = {"return_token_ids": True}
    if rollpatch:
        extra["rollpatch"] = rollpatch
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body=extra,
    )
    return raw.parse().model_dump(), dict(raw.headers)
