"""Mixture-of-experts: a version committed while a response is being generated. Behind a
sidecar in drain mode the commit waits for the stream, so its routing has one version; in pause
mode it lands mid-generation and the spans say which version routed which rows, each span equal
to what Hugging Face transformers routes under that version. The served model, its board and
the transformers replay: tests/test_moe.py (``World``).
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

from rollpatch.engines.reference import ReferenceEngine
from rollpatch.follower import FollowerConfig
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import start_sidecar
from tests.test_moe import LAYERS, MAX_TOKENS, PROMPT, TOP_K, World, _decode, _stream_choice


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """Its own board: these tests publish versions as they go."""
    return World(tmp_path_factory.mktemp("moe-commits"))


# ---- a version published mid-stream, behind a sidecar in each commit mode ------------------


@pytest.mark.parametrize("mode", ["drain", "pause"])
def test_publish_mid_stream_through_the_sidecar(world: World, mode: str) -> None:
    """Drain: the commit waits for the stream, so its routing has one version (by
    construction). Pause: the commit lands mid-stream and the spans say where."""
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    sc = start_sidecar(
        world.board,
        "moe",
        engine,
        engine.url,
        config=SidecarConfig(
            commit_mode=mode,  # type: ignore[arg-type]
            follower=FollowerConfig(poll_s=0.05),
        ),
    )
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{sc.url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "sidecar never became ready"
            time.sleep(0.05)
        old = max(world.views)
        hold_at, published = 4, []

        def hook(i: int) -> None:  # in the engine's generating thread, outside every lock
            if i != hold_at:
                return
            published.append(world.publish())
            end = time.monotonic() + (30 if mode == "pause" else 1.0)
            while time.monotonic() < end and engine.runtime.version != published[0]:
                time.sleep(0.02)

        engine.runtime.step_hook = hook
        last, rp = _stream_choice(f"{sc.url}/v1", old)
        engine.runtime.step_hook = None
        new = published[0]
        n = len(world.prompt_ids) + MAX_TOKENS - 1
        rows = _decode(last["routed_experts"])
        assert rows.shape == (n, LAYERS, TOP_K)
        if mode == "drain":
            assert rp["version_start"] == rp["version_end"] == old
            assert rp["spans"] == [{"start": 0, "end": n, "version": old}]
            hf_rows, _ = world.hf_routing(old, world.prompt_ids + last["token_ids"][:-1])
            assert np.array_equal(rows, hf_rows)  # the whole response replays under ``old``
        else:
            cut = len(world.prompt_ids) + hold_at
            assert (rp["version_start"], rp["version_end"]) == (old, new)
            assert rp["spans"] == [
                {"start": 0, "end": cut, "version": old},
                {"start": cut, "end": n, "version": new},
            ]
            hf_rows, _ = world.hf_routing(old, (world.prompt_ids + last["token_ids"])[:cut])
            assert np.array_equal(rows[:cut], hf_rows)
        after = httpx.post(
            f"{sc.url}/v1/completions",
            timeout=120,
            json={
                "prompt": PROMPT,
                "max_tokens": 2,
                "rollpatch": {"exact_version": new, "wait_s": 60},
            },
        ).json()
        assert after["rollpatch"]["spans"][0]["version"] == new
    finally:
        engine.runtime.step_hook = None
        sc.stop()


# ---- pause mode: a commit mid-generation is labelled per span -----------------------------


def test_commit_mid_generation_labels_the_spans(world: World) -> None:
    """Pause mode: rows routed before the commit carry the old version and equal HF's
    routing under it; rows after carry the new version."""
    engine = ReferenceEngine.from_dir(world.model, threads=1, serve_http=False)
    rt = engine.runtime
    old, new = sorted(world.views)[-2:]
    engine.load(world.views[old], old)
    switch_at = 3

    def hook(i: int) -> None:
        if i == switch_at:
            engine.pause()
            engine.load(world.views[new], new)
            engine.resume()

    rt.step_hook = hook
    gen = rt.generate(world.prompt_ids, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tokens = [s.token_id for s in gen]
    rows = gen.routed_experts()
    assert rows is not None
    cut = len(world.prompt_ids) + switch_at  # forwards 0..switch_at ran under ``old``
    assert gen.routed_spans() == [
        {"start": 0, "end": cut, "version": old},
        {"start": cut, "end": len(rows), "version": new},
    ]
    assert (gen.version_start, gen.version_end) == (old, new)
    hf_rows, _ = world.hf_routing(old, (world.prompt_ids + tokens)[:cut])
    assert np.array_equal(rows[:cut], hf_rows)
    engine.close()
