"""A tiny Llama-style causal LM plus a byte-level BPE tokenizer, made locally in code.

No hub access: the model is randomly initialised (deterministic by seed) and the tokenizer is
trained on text generated here. Used by the tests and the demo; any real Hugging Face causal
LM directory works with :class:`~rollpatch.engines.reference.runtime.ReferenceRuntime` too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from ...errors import ConfigError

__all__ = [
    "CHAT_TEMPLATE",
    "DENSE_ARCHS",
    "SPECIAL_TOKENS",
    "DenseArch",
    "make_tiny_model",
    "make_tiny_moe_model",
    "make_tokenizer",
]

#: The dense architectures :func:`make_tiny_model` makes: (model class, config class).
DenseArch = Literal["llama", "qwen2", "qwen3"]
DENSE_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
}

#: Special tokens of the tiny tokenizer; ``<|eos|>`` also ends each chat turn.
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]

#: A minimal chat template: ``<|role|>\ncontent<|eos|>\n`` per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|eos|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "ze",
    "po",
    "qua",
    "rix",
    "tem",
    "bal",
    "dor",
    "fen",
    "gil",
    "hum",
    "jor",
    "kel",
    "mar",
    "nol",
    "pre",
    "sto",
]
_WORDS = [
    "the",
    "policy",
    "weights",
    "patch",
    "engine",
    "version",
    "token",
    "model",
    "reward",
    "train",
    "serve",
    "step",
    "value",
    "sum",
    "of",
    "and",
    "is",
    "what",
    "answer",
    "a",
]


def _corpus(seed: int, lines: int = 6000) -> Iterator[str]:
    """Arithmetic, words and made-up words: enough distinct pairs for a 2k-token BPE."""
    rng = random.Random(seed)
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        res = a + b if op == "+" else a - b if op == "-" else a * b
        made = " ".join(
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(2, 6))
        )
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8)))
        yield f"What is {a} {op} {b}? The answer is {res}. {words.capitalize()}, {made}.\n"


def make_tokenizer(path: str | Path, *, vocab_size: int = 2048, seed: int = 0) -> Path:
    """Train a byte-level BPE of exactly ``vocab_size`` ids and save it (fast tokenizer files).

    Missing ids (when the corpus runs out of merges) are filled with reserved special tokens,
    so the tokenizer's size always equals the model's embedding size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ConfigError("vocab_size too small for a byte-level BPE", vocab_size=vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(path)
    fast.save_pretrained(out)
    return out


def _check_heads(hidden_size: int, heads: int, kv_heads: int) -> None:
    if hidden_size % heads or heads % kv_heads:
        raise ConfigError(
            "hidden_size must divide by heads and heads by kv_heads",
            hidden_size=hidden_size,
            heads=heads,
            kv_heads=kv_heads,
        )


def _save_model(
    path: str | Path,
    config: dict[str, Any],
    build: Callable[[dict[str, Any]], Any],
    *,
    vocab_size: int,
    seed: int,
    tied: bool = False,
) -> Path:
    """Train the tokenizer, build the model (``build``) from ``config`` plus what every tiny
    model shares (special token ids, BF16; lm_head untied unless ``tied``) under ``seed``;
    save both."""
    import torch
    from transformers import AutoTokenizer

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, vocab_size=vocab_size, seed=seed)
    tok = AutoTokenizer.from_pretrained(out)
    kwargs = {
        **config,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tied,
        "dtype": "bfloat16",
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(kwargs)
    model = model.bfloat16()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)  # safetensors by default
    return out


def make_tiny_model(
    path: str | Path,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    seed: int = 0,
    tied: bool = False,
    arch: DenseArch = "llama",
) -> Path:
    """Save a random BF16 dense causal LM and its tokenizer to ``path``; ``tied``: the
    lm_head is the embedding (``tie_word_embeddings``, as Llama-3.2-1B/3B and the small
    Qwen2.5 models; the checkpoint then holds no ``lm_head.weight``), else its own tensor.

    ``arch``: ``llama`` (``LlamaForCausalLM``), ``qwen2`` (``Qwen2ForCausalLM``: biases on
    q, k and v, as the Qwen2.5 family the RL recipes start from) or ``qwen3``
    (``Qwen3ForCausalLM``: RMS norms on q and k per head). Deterministic by ``seed``: the same
    arguments give the same bits. Returns ``path``.
    """
    import transformers

    if arch not in DENSE_ARCHS:
        raise ConfigError(f"unknown arch {arch!r}", hint=f"one of {', '.join(DENSE_ARCHS)}")
    cls_name, config_name = DENSE_ARCHS[arch]
    model_cls, config_cls = getattr(transformers, cls_name), getattr(transformers, config_name)
    _check_heads(hidden_size, heads, kv_heads)
    extra = {"head_dim": hidden_size // heads} if arch == "qwen3" else {}
    return _save_model(
        path,
        {
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            **extra,
        },
        lambda kw: model_cls(config_cls(**kw)),
        vocab_size=vocab_size,
        seed=seed,
        tied=tied,
    )


def make_tiny_moe_model(
    path: str | Path,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 8,
    top_k: int = 2,
    moe_intermediate: int = 64,
    seed: int = 0,
) -> Path:
    """Save a random BF16 ``Qwen3MoeForCausalLM`` (every layer sparse, ``experts`` experts,
    ``top_k`` routed per token, untied lm_head) and its tokenizer to ``path``.

    The checkpoint holds one tensor per expert (``...mlp.experts.{e}.gate_proj.weight``), as
    published Qwen3-MoE checkpoints do; vLLM and the built-in engine both load it.
    Deterministic by ``seed``. Returns ``path``.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _check_heads(hidden_size, heads, kv_heads)
    if not 1 <= top_k <= experts:
        raise ConfigError("top_k must be in [1, experts]", top_k=top_k, experts=experts)
    return _save_model(
        path,
        {
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "moe_intermediate_size": moe_intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": hidden_size // heads,  # a Qwen3 config field
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
        lambda kw: Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)),
        vocab_size=vocab_size,
        seed=seed,
    )
