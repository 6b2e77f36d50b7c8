"""Qwen-family dense models live in a real vLLM on the CPU: the models most RL recipes start
from. ``qwen2`` (Qwen2.5: biases on q, k and v, which vLLM fuses into ``qkv_proj.bias``;
tied embeddings, as Qwen2.5-0.5B/1.5B/3B) and ``qwen3`` (Qwen3: an RMS norm on q and k per
head, ``q_norm``/``k_norm``, which the Llama family has not). The Llama family is covered by
tests/test_vllm.py and tests/test_vllm_sidecar.py.

Per architecture, one vLLM server booted from version 0's checkpoint; a follower with
``boot="adopt"`` takes it over and patches it to the last version, in which every tensor moved
(the biases and the q/k norms included) far enough that a parameter left behind changes the
logits. Checked: the names the run publishes are the names vLLM holds, the workers' full
re-hash is the published digest (vLLM's fused ``qkv_proj.bias`` and its q/k norms included),
and vLLM's greedy tokens and logprobs agree with Hugging Face transformers on the last
version's weights (teacher-forced) and not on version 0's.

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
from rollpatch.publisher import Publisher, reconstruct
from tests import vllm_env

PROMPTS = ["What is 12 + 7? The answer is", "ka lo mi ne ru sa ti vo ze po qua rix tem bal dor"]
#: arch -> (tied, the tensors of layer 0 that only this family has)
ARCHS = {
    "qwen2": (True, ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
    "qwen3": (False, ("q_norm.weight", "k_norm.weight")),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def world(
    request: pytest.FixtureRequest, vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Versions 0..2 of a tiny model of the family published from its state dict, and one
    vLLM server booted from version 0's checkpoint."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from rollpatch.engines.reference import make_tiny_model

    arch: str = request.param
    tied, own = ARCHS[arch]
    root = tmp_path_factory.mktemp(f"{arch}-live")
    model_dir = make_tiny_model(
        root / "v0", arch=arch, tied=tied, seed=5, hidden_size=256, intermediate=512
    )
    board = f"file://{root / 'board'}"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with Publisher(board, arch, asynchronous=False) as pub, torch.no_grad():
        assert pub.publish(hf.state_dict()) == 0
        for v in (1, 2):
            for _, p in hf.named_parameters():  # a tied head once, through the embedding
                # constant-initialised tensors (zero biases, unit q/k norms) have no spread
                # of their own: they move by 0.25 at v2
                scale = 0.5 if v == 2 else 3e-3
                std = float(p.std()) if p.numel() > 1 else 0.0
                step = scale * (std if std > 1e-6 else 0.5)
                p.add_(step * torch.randn(p.shape, generator=gen))
            assert pub.publish(hf.state_dict()) == v
    views = [reconstruct(board, arch, v) for v in range(3)]
    for name in own:
        t0, t2 = (
            views[0][f"model.layers.0.self_attn.{name}"],
            views[2][f"model.layers.0.self_attn.{name}"],
        )
        assert not np.array_equal(t0.data, t2.data), name  # the family's own tensors moved
    srv = vllm_env.start_server(
        vllm_python,
        model_dir,
        root / "vllm.log",
        env=vllm_env.REPO_ON_PATH,
    )
    try:
        srv.wait_ready(300)
        yield {"arch": arch, "server": srv, "model": model_dir, "board": board, "views": views}
    finally:
        srv.stop()


def test_a_qwen_family_model_is_adopted_patched_and_served_right(world: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    arch, server, model_dir, views = world["arch"], world["server"], world["model"], world["views"]
    engine = VllmEngine(server.url)
    try:
        assert sorted(engine.info()["tensors"]) == sorted(views[0])  # what vLLM holds
        config = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=120.0, boot="adopt")
        f = Follower(world["board"], arch, engine, config)
        assert f.sync() == 2
        assert f.status().adoptions == 1 and f.last_plan is not None
        assert not any(s.is_keyframe for s in f.last_plan.steps)
        assert engine.held(fresh=True) == (views[2].tensor_digests(), views[2].digest())
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt_ids = [tok(p).input_ids for p in PROMPTS]
        outs = server.greedy(model_dir, prompt_ids)
        for ids, (toks, lps) in zip(prompt_ids, outs):
            now = vllm_env.hf_logprobs(model_dir, views[2], ids, toks)
            assert np.allclose(now, lps, atol=0.03), (arch, now, lps)
            before = vllm_env.hf_logprobs(model_dir, views[0], ids, toks)
            assert not np.allclose(before, lps, atol=0.03), arch
    finally:
        engine.close()
