"""Model families live in a real vLLM on the CPU, beyond the untied Llama of tests/test_vllm.py
and tests/test_vllm_sidecar.py: the models most RL recipes start from.

- ``llama-tied``: tied embeddings (``tie_word_embeddings``: Llama-3.2-1B and 3B). The checkpoint
  holds no ``lm_head.weight``; the trainer's ``model.state_dict()`` holds it as an alias of the
  embedding, which the publisher publishes once (docs/publisher.md, *Guards*); vLLM's head is
  the embedding module, whose CPU kernel keeps its own packed copy of the words for the logits.
  At the last version only the embedding moved far, so logits from a stale head are plainly
  wrong (before session 37 they were: docs/vllm.md, *The CPU prepack trap*).
- ``qwen2``: Qwen2.5 (biases on q, k and v, which vLLM fuses into ``qkv_proj.bias``; tied, as
  Qwen2.5-0.5B to 3B).
- ``qwen3``: Qwen3 (an RMS norm on q and k per head, ``q_norm``/``k_norm``).

Per model, one vLLM server booted from version 0's checkpoint; a follower with ``boot="adopt"``
takes it over (no keyframe) and patches it to the last version. Checked: the names the run
publishes are the names vLLM holds, the workers' full re-hash is the published digest (vLLM's
fused ``qkv_proj.bias`` and its q/k norms included), and vLLM's greedy tokens and logprobs agree
with Hugging Face transformers on the last version's weights (teacher-forced) and not on
version 0's.

What the logprobs do not show: a tiny random model's near-uniform output hardly feels its q/k/v
biases. With only the biases left at version 0's, HF's logprobs of vLLM's tokens moved by 0.03
where vLLM and HF already differed by 0.016 (biases moved by 2.5), so that check could not tell;
the biases are covered by the workers' re-hash of vLLM's own parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.vllm import VllmEngine
from rollpatch.follower import Follower, FollowerConfig
from tests import modelfams, vllm_env
from tests.modelfams import FAMILIES, PROMPTS


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def world(
    request: pytest.FixtureRequest, vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Versions 0..2 of a tiny model of the family published from its state dict
    (tests/modelfams.py), and one vLLM server booted from version 0's checkpoint."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    run: str = request.param
    root = tmp_path_factory.mktemp(f"{run}-live")
    pub = modelfams.publish(run, root)
    model_dir, board, views = pub.model, pub.board, pub.views
    srv = vllm_env.start_server(
        vllm_python, model_dir, root / "vllm.log", env=vllm_env.REPO_ON_PATH
    )
    try:
        srv.wait_ready(300)
        yield {"run": run, "server": srv, "model": model_dir, "board": board, "views": views}
    finally:
        srv.stop()


def test_a_model_is_adopted_patched_and_served_right(world: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    run, server, model_dir, views = world["run"], world["server"], world["model"], world["views"]
    engine = VllmEngine(server.url)
    try:
        assert sorted(engine.info()["tensors"]) == sorted(views[0])  # what vLLM holds
        config = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=120.0, boot="adopt")
        f = Follower(world["board"], run, engine, config)
        assert f.sync() == 2
        assert f.status().adoptions == 1 and f.last_plan is not None and f.last_plan.have == 0
        assert not any(s.is_keyframe for s in f.last_plan.steps)
        assert engine.held(fresh=True) == (views[2].tensor_digests(), views[2].digest())
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt_ids = [tok(p).input_ids for p in PROMPTS]
        outs = server.greedy(model_dir, prompt_ids)
        for ids, (toks, lps) in zip(prompt_ids, outs):
            now = vllm_env.hf_logprobs(model_dir, views[2], ids, toks)
            assert np.allclose(now, lps, atol=0.03), (run, now, lps)
            before = vllm_env.hf_logprobs(model_dir, views[0], ids, toks)  # a stale model's
            assert not np.allclose(before, lps, atol=0.03), run
    finally:
        engine.close()
