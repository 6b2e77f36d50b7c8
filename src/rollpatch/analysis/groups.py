"""Tensor groups by checkpoint name: embeddings, attention, MLP, experts, router, norms,
lm_head, other.

The rules look at the dot-separated segments of the lower-cased name, first match wins:

1. ``lm_head``: a segment ``lm_head`` or ``embed_out``, or a top-level ``output.*``
   (Meta's Llama naming).
2. ``norms``: a segment containing ``norm`` (``input_layernorm``, ``q_norm``, ``norm``,
   ``LayerNorm``...) or a GPT-2 style ``ln``, ``ln_1``, ``ln_f``.
3. ``embeddings``: a segment containing ``embed`` (``embed_tokens``, ``word_embeddings``,
   ``tok_embeddings``...) or ``wte``/``wpe``.
4. ``attention``: a segment containing ``attn`` or ``attention`` (``self_attn``), or one of
   ``q_proj k_proj v_proj o_proj qkv_proj query_key_value wq wk wv wo query key value``.
5. ``router``: a segment ``router``, ``shared_expert_gate``, or ``gate`` right after an MoE
   block (``mlp``, ``block_sparse_moe``, ``moe``, ``feed_forward``, ``ffn``): Qwen3-MoE and
   DeepSeek ``mlp.gate.weight``, Mixtral ``block_sparse_moe.gate.weight``.
6. ``experts``: a segment ``experts`` or ``local_experts`` (routed experts, one tensor each
   as in ``mlp.experts.7.up_proj.weight``, or fused as in ``mlp.experts.gate_up_proj``).
   Shared experts (``shared_expert``, ``shared_experts``: every token goes through them) are
   ``mlp``.
7. ``mlp``: a segment containing ``mlp``, ``ffn``, ``feed_forward`` or ``expert``, or one of
   ``gate_proj up_proj down_proj gate_up_proj w1 w2 w3 fc1 fc2 c_fc dense_h_to_4h
   dense_4h_to_h``.
8. ``other``: everything else.

Served names of quantised formats (``...weight_scale``) land with their weight, and biases
with their module, since the rules read the module segments.
"""

from __future__ import annotations

import re

from ..formats.policy import is_router

__all__ = ["GROUPS", "tensor_group"]

#: Group names, in report order.
GROUPS: tuple[str, ...] = (
    "embeddings",
    "attention",
    "mlp",
    "experts",
    "router",
    "norms",
    "lm_head",
    "other",
)

_EXPERTS = {"experts", "local_experts"}

_LN = re.compile(r"^ln(_?[0-9a-z])?$")
_ATTN = {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "query_key_value",
    "wq",
    "wk",
    "wv",
    "wo",
    "query",
    "key",
    "value",
}
_MLP = {
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "w1",
    "w2",
    "w3",
    "fc1",
    "fc2",
    "c_fc",
    "dense_h_to_4h",
    "dense_4h_to_h",
}


def tensor_group(name: str) -> str:
    """The group (one of :data:`GROUPS`) a tensor belongs to, by its name (module doc)."""
    segs = name.lower().split(".")
    if any(s in ("lm_head", "embed_out") for s in segs) or (segs[0] == "output" and len(segs) == 2):
        return "lm_head"
    if any("norm" in s or _LN.match(s) for s in segs):
        return "norms"
    if any("embed" in s or s in ("wte", "wpe") for s in segs):
        return "embeddings"
    if any("attn" in s or "attention" in s or s in _ATTN for s in segs):
        return "attention"
    if is_router(name):  # one owner of the rule: the quantisation policy keeps routers BF16
        return "router"
    if any(s in _EXPERTS for s in segs):
        return "experts"
    if any(
        "mlp" in s or "ffn" in s or "feed_forward" in s or "expert" in s or s in _MLP for s in segs
    ):
        return "mlp"
    return "other"
