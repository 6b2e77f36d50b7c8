"""A tied-embedding model live in a real vLLM on the CPU (``tie_word_embeddings``: Llama-3.2-1B
and 3B, the small Qwen2.5 models). Its checkpoint holds no ``lm_head.weight``; the trainer's
``model.state_dict()`` holds it as an alias of the embedding, which the publisher publishes once
(docs/publisher.md, *Guards*); vLLM's head is the embedding module, whose CPU kernel keeps its
own packed copy of the words for the logits.

One server booted from version 0's checkpoint; a follower with ``boot="adopt"`` takes it over
(no keyframe) and patches it to the last version, in which the embedding moved far enough that
logits from a stale head would be plainly wrong. Checked: the names the run publishes are the
names vLLM holds, the workers' full re-hash is the published digest, and vLLM's greedy tokens
and logprobs agree with Hugging Face transformers on the last version's weights (teacher-forced)
and not on version 0's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.vllm import VllmEngine
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.io.safetensors import load_view
from rollpatch.publisher import Publisher, reconstruct
from tests import vllm_env

RUN = "tied"
EMBED = "model.embed_tokens.weight"
PROMPTS = ["What is 12 + 7? The answer is", "ka lo mi ne ru sa ti vo ze po qua rix tem bal dor"]


@pytest.fixture(scope="module")
def world(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Versions 0..2 of a tied tiny Llama published from its state dict, and one vLLM server
    booted from version 0's checkpoint."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from rollpatch.engines.reference import make_tiny_model

    root = tmp_path_factory.mktemp("tied-live")
    model_dir = make_tiny_model(root / "v0", tied=True, seed=3, hidden_size=256, intermediate=512)
    assert "lm_head.weight" not in load_view(model_dir / "model.safetensors")
    board = f"file://{root / 'board'}"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sd = hf.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd[EMBED].data_ptr()  # tied
    gen = torch.Generator().manual_seed(0)
    with Publisher(board, RUN, asynchronous=False) as pub, torch.no_grad():
        assert pub.publish(hf.state_dict()) == 0
        for v in (1, 2):
            for name, p in hf.named_parameters():  # the head once, through the embedding
                scale = 0.5 if (v == 2 and name == EMBED) else 3e-3
                p.add_(scale * float(p.std()) * torch.randn(p.shape, generator=gen))
            assert pub.publish(hf.state_dict()) == v
    views = [reconstruct(board, RUN, v) for v in range(3)]
    srv = vllm_env.start_server(
        vllm_python,
        model_dir,
        root / "vllm.log",
        env=vllm_env.REPO_ON_PATH,
    )
    try:
        srv.wait_ready(300)
        yield {"server": srv, "model": model_dir, "board": board, "views": views}
    finally:
        srv.stop()


def test_a_tied_model_is_adopted_patched_and_served_right(world: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    server, model_dir, views = world["server"], world["model"], world["views"]
    assert "lm_head.weight" not in views[0]  # published once, under the embedding's name
    engine = VllmEngine(server.url)
    try:
        assert sorted(engine.info()["tensors"]) == sorted(views[0])  # what vLLM holds
        config = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=120.0, boot="adopt")
        f = Follower(world["board"], RUN, engine, config)
        assert f.sync() == 2
        st = f.status()
        assert st.adoptions == 1 and f.last_plan is not None and f.last_plan.have == 0
        assert not any(s.is_keyframe for s in f.last_plan.steps)
        assert engine.held(fresh=True) == (views[2].tensor_digests(), views[2].digest())
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt_ids = [tok(p).input_ids for p in PROMPTS]
        outs = server.greedy(model_dir, prompt_ids)
        for ids, (toks, lps) in zip(prompt_ids, outs):
            now = vllm_env.hf_logprobs(model_dir, views[2], ids, toks)
            assert np.allclose(now, lps, atol=0.03), (now, lps)
            before = vllm_env.hf_logprobs(model_dir, views[0], ids, toks)  # a stale head's logits
            assert not np.allclose(before, lps, atol=0.03)
    finally:
        engine.close()
