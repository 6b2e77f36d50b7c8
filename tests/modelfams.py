"""Model families for the live engine tests (tests/test_vllm_models_live.py,
tests/test_sglang_models_live.py): a tiny model of each, three versions published from its
trainer-side ``state_dict()`` (a tied head once, through the embedding), and the views."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollpatch.view import View

EMBED = "model.embed_tokens.weight"
PROMPTS = ["What is 12 + 7? The answer is", "ka lo mi ne ru sa ti vo ze po qua rix tem bal dor"]


@dataclass(frozen=True)
class Family:
    arch: str
    tied: bool
    seed: int
    #: layer 0's tensors (of self_attn) only this family has, checked to have moved
    own: tuple[str, ...] = ()
    #: the one tensor that moves far at the last version (None: every tensor does)
    far: str | None = None


FAMILIES = {
    "llama-tied": Family("llama", tied=True, seed=3, far=EMBED),
    "qwen2": Family("qwen2", tied=True, seed=5, own=("q_proj.bias", "k_proj.bias", "v_proj.bias")),
    "qwen3": Family("qwen3", tied=False, seed=5, own=("q_norm.weight", "k_norm.weight")),
}


@dataclass(frozen=True)
class Published:
    model: Path  # version 0's checkpoint (the engine boots from it)
    board: str
    views: list[View]  # versions 0..2 as published


def publish(run: str, root: Path) -> Published:
    """Versions 0..2 of family ``run``'s tiny model, published to a board under ``root``.

    Every tensor moves a little per version, and at version 2 far (or only ``far`` does):
    constant-initialised tensors (zero biases, unit q/k norms), with no spread of their own,
    move by 0.25 then."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollpatch.engines.reference import make_tiny_model
    from rollpatch.io.safetensors import load_view
    from rollpatch.publisher import Publisher, reconstruct

    fam = FAMILIES[run]
    model_dir = make_tiny_model(
        root / "v0", arch=fam.arch, tied=fam.tied, seed=fam.seed, hidden_size=256, intermediate=512
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if fam.tied:
        assert "lm_head.weight" not in load_view(model_dir / "model.safetensors")
        sd = hf.state_dict()
        assert sd["lm_head.weight"].data_ptr() == sd[EMBED].data_ptr()
    board = f"file://{root / 'board'}"
    gen = torch.Generator().manual_seed(1)
    with Publisher(board, run, asynchronous=False) as pub, torch.no_grad():
        assert pub.publish(hf.state_dict()) == 0
        for v in (1, 2):
            for name, p in hf.named_parameters():  # a tied head once, through the embedding
                far = v == 2 and fam.far in (None, name)
                std = float(p.std()) if p.numel() > 1 else 0.0
                step = (0.5 if far else 3e-3) * (std if std > 1e-6 else 0.5)
                p.add_(step * torch.randn(p.shape, generator=gen))
            assert pub.publish(hf.state_dict()) == v
    views = [reconstruct(board, run, v) for v in range(3)]
    if fam.tied:
        assert "lm_head.weight" not in views[0]  # published once, under the embedding's name
    for name in (f"model.layers.0.self_attn.{t}" for t in fam.own):
        assert not np.array_equal(views[0][name].data, views[2][name].data), name
    return Published(model_dir, board, views)
