"""The demo's policy model: made locally, given a format warm-up, trained with GRPO steps."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .config import DemoConfig
from .grpo import Rollout, clipped_surrogate, group_advantages
from .task import DigitTask

__all__ = ["ensure_model", "grpo_step", "load_policy", "served_state", "warm_up"]

_WARMUP_LR = 3e-3
_WARMUP_BATCH = 64


def _shape(cfg: DemoConfig) -> dict[str, int]:
    shape = {
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden,
        "layers": cfg.layers,
        "heads": 4,
        "kv_heads": 2,
        "seed": cfg.seed,
    }
    if cfg.model == "moe":
        return {
            **shape,
            "experts": cfg.experts,
            "top_k": cfg.top_k,
            "moe_intermediate": cfg.hidden // 2,
        }
    return {**shape, "intermediate": 2 * cfg.hidden}


def ensure_model(cfg: DemoConfig, model_dir: Path) -> Path:
    """Make the tiny model (random init, by seed) unless ``model_dir`` already holds it."""
    from ..engines.reference import make_tiny_model, make_tiny_moe_model

    stamp = model_dir / "rollpatch-demo-model.json"
    shape = _shape(cfg)
    if stamp.exists() and json.loads(stamp.read_text()) == {"model": cfg.model, **shape}:
        return model_dir
    if model_dir.exists():  # another shape or architecture: no stale file may survive
        shutil.rmtree(model_dir)
    make: Callable[..., Path] = make_tiny_moe_model if cfg.model == "moe" else make_tiny_model
    make(model_dir, **shape)
    stamp.write_text(json.dumps({"model": cfg.model, **shape}))
    return model_dir


def served_state(model: Any) -> dict[str, Any]:
    """The master tensors under the names the engines serve (the checkpoint's).

    transformers holds an MoE block's experts fused (``experts.gate_up_proj`` ``[E, 2I, H]``);
    checkpoints, engines and so the published view name one tensor per expert
    (``experts.{e}.gate_proj.weight``). Each is a contiguous slice of the fused master: no
    copy. A dense model's state dict is returned as it is.
    """
    from ..engines.reference.experts import checkpoint_name, split_experts

    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        parts = split_experts(model, name, t)
        if parts is None:
            out[checkpoint_name(model, name)] = t
        else:
            out.update(parts)
    return out


def load_policy(model_dir: Path) -> tuple[Any, Any]:
    """(FP32 master model in train mode, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _last_logprobs(model: Any, prompts: Sequence[Sequence[int]]) -> Any:
    import torch

    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
    return torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)


def warm_up(model: Any, task: DigitTask, cfg: DemoConfig) -> float:
    """The unpublished warm-up before version 0; returns the probability mass the model then
    puts on digit tokens.

    ``fast`` regime: a *format* warm-up (below). ``real`` regime: a supervised phase on the
    task itself, every parameter, whose targets are the right answer half of the time and a
    random digit otherwise, so the policy starts partly skilled (P(right) ≈ 0.4-0.5) and RL
    at a post-training learning rate refines it, as RL after SFT does.
    """
    if cfg.regime == "real":
        return _supervised(model, task, cfg, right=0.5)
    return _format_warm_up(model, task, cfg)


def _supervised(model: Any, task: DigitTask, cfg: DemoConfig, *, right: float) -> float:
    import torch

    if cfg.warmup_steps == 0:
        return float("nan")
    rng = np.random.default_rng([cfg.seed, 8])
    opt = torch.optim.AdamW(model.parameters(), lr=_WARMUP_LR)
    for _ in range(cfg.warmup_steps):
        ds = rng.integers(0, 10, _WARMUP_BATCH)
        keep = rng.random(_WARMUP_BATCH) < right
        noise = rng.integers(0, 10, _WARMUP_BATCH)
        targets = torch.tensor(
            [task.answer(int(d)) if k else task.digits[int(x)] for d, k, x in zip(ds, keep, noise)]
        )
        lp = _last_logprobs(model, [task.prompt(int(d)) for d in ds])
        loss = -lp[torch.arange(_WARMUP_BATCH), targets].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _digit_mass(model, task)


def _digit_mass(model: Any, task: DigitTask) -> float:
    import torch

    with torch.no_grad():
        lp = _last_logprobs(model, [task.prompt(d) for d in range(10)])
        return float(lp[:, torch.tensor(task.digits)].exp().sum(-1).mean())


def _format_warm_up(model: Any, task: DigitTask, cfg: DemoConfig) -> float:
    """Supervised *format* warm-up of the output layer only: answer every prompt with a
    uniformly random digit.

    It teaches the answer format (a digit token), not the task: targets are independent of
    the prompt, so the expected reward stays at chance (10%). Only ``lm_head`` is trained, so
    the rest of the network keeps the prompt-dependent features of its random init (training
    everything to a prompt-independent target flattens them, and RL then stalls for dozens of
    steps). Returns the probability mass the model then puts on digit tokens.
    """
    import torch

    if cfg.warmup_steps == 0:
        return float("nan")
    rng = np.random.default_rng([cfg.seed, 7])
    opt = torch.optim.AdamW(model.get_output_embeddings().parameters(), lr=_WARMUP_LR)
    digits = torch.tensor(task.digits)
    for _ in range(cfg.warmup_steps):
        prompts = [task.prompt(task.sample(rng)) for _ in range(_WARMUP_BATCH)]
        targets = digits[torch.from_numpy(rng.integers(0, 10, _WARMUP_BATCH))]
        lp = _last_logprobs(model, prompts)
        loss = -lp[torch.arange(_WARMUP_BATCH), targets].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        lp = _last_logprobs(model, [task.prompt(d) for d in range(10)])
        return float(lp[:, digits].exp().sum(-1).mean())


def grpo_step(
    model: Any, opt: Any, groups: Sequence[Sequence[Rollout]], clip: float
) -> dict[str, float]:
    """One optimizer step on complete groups: group advantages, clipped importance ratios."""
    import torch

    rollouts = [r for g in groups for r in g]
    adv = np.concatenate([group_advantages([r.reward for r in g]) for g in groups])
    lp = _last_logprobs(model, [r.prompt for r in rollouts])
    tokens = torch.tensor([r.token for r in rollouts])
    logp_current = lp[torch.arange(len(rollouts)), tokens]
    logp_behaviour = torch.tensor([r.logprob for r in rollouts], dtype=torch.float32)
    loss, stats = clipped_surrogate(
        logp_current, logp_behaviour, torch.tensor(adv, dtype=torch.float32), clip
    )
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": float(loss.detach()), **stats}
