"""Qwen-family models live in a real SGLang on the CPU (the untied Llama: tests/test_sglang.py):
``qwen2`` (Qwen2.5: biases on q, k and v, which SGLang fuses into ``qkv_proj.bias``; tied
embeddings, as Qwen2.5-0.5B to 3B) and ``qwen3`` (Qwen3: ``q_norm``/``k_norm``). The same
versions as tests/test_vllm_models_live.py (tests/modelfams.py).

Per family, one SGLang server booted from version 0's checkpoint; a follower with
``boot="adopt"`` takes it over (no keyframe) and patches it to the last version. Checked: the
names and shapes SGLang holds are the run's, every rank's full re-hash is the published digest,
SGLang's ``weight_version`` names the version, and its greedy tokens and logprobs agree with
Hugging Face transformers on the last version's weights (teacher-forced) and not on version
0's; SGLang never called its ``sgl_kernel`` import shim. (The logprobs hardly feel the q/k/v
biases of a tiny random model: tests/test_vllm_models_live.py; the re-hash covers them.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.fit import tensors_of_view
from rollpatch.follower import Follower, FollowerConfig
from tests import modelfams, sglang_env, vllm_env
from tests.modelfams import PROMPTS

RUNS = ("qwen2", "qwen3")
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=RUNS)
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Versions 0..2 of the family's tiny model, and one SGLang server booted from version 0."""
    python = sglang_env.sglang_python()
    if python is None:
        pytest.skip(
            f"SKIPPED LIVE SGLANG TESTS: no SGLang venv at {sglang_env.venv_dir()}: "
            f"{sglang_env.BUILD_HINT}"
        )
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    run: str = request.param
    root = tmp_path_factory.mktemp(f"{run}-sglang")
    pub = modelfams.publish(run, root)
    shim_log = root / "sgl-kernel-shim.log"
    srv = sglang_env.start_server(python, pub.model, root / "sglang.log", shim_log)
    try:
        srv.wait_ready(300)
        yield {"run": run, "server": srv, "pub": pub}
        calls = shim_log.read_text() if shim_log.exists() else ""
        assert calls == "", f"SGLang called the sgl_kernel shim:\n{calls}"
    finally:
        srv.stop()


def test_a_qwen_model_is_adopted_patched_and_served_right(world: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    from rollpatch.engines.sglang import SglangEngine

    run, server, pub = world["run"], world["server"], world["pub"]
    views = pub.views
    engine = SglangEngine(server.url)
    try:
        assert engine.model_tensors() == tensors_of_view(views[0])  # what SGLang holds
        config = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=120.0, boot="adopt")
        f = Follower(pub.board, run, engine, config)
        assert f.sync() == 2
        assert f.status().adoptions == 1 and f.last_plan is not None and f.last_plan.have == 0
        assert not any(s.is_keyframe for s in f.last_plan.steps)
        assert engine.held(fresh=True) == (views[2].tensor_digests(), views[2].digest())
        tok = AutoTokenizer.from_pretrained(pub.model)
        prompt_ids = [tok(p).input_ids for p in PROMPTS]
        outs, tags = sglang_env.greedy(server, prompt_ids, MAX_TOKENS)
        assert tags == {"2"}
        for ids, (toks, lps) in zip(prompt_ids, outs):
            now = vllm_env.hf_logprobs(pub.model, views[2], ids, toks)
            assert np.allclose(now, lps, atol=0.03), (run, now, lps)
            before = vllm_env.hf_logprobs(pub.model, views[0], ids, toks)
            assert not np.allclose(before, lps, atol=0.03), run
    finally:
        engine.close()
