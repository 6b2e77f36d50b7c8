"""The parallel-layer reader shared by the vLLM and SGLang extensions (inside the engine).

SGLang's parallel layers are adapted from vLLM's and split tensors the same way, so one
reader turns a layer of either engine into a :class:`~rollpatch.engines.vllm.layout.ParamSpec`
from the layer's own metadata: ``QKVParallelLinear`` head counts, sizes and KV-head replicas,
``MergedColumnParallelLinear.output_sizes``, the split of column and row layers, and the
padding of ``VocabParallelEmbedding``. Each engine passes its own layer classes
(:class:`ParallelLayers`) and its own fused-module table; what only one engine has (vLLM's MoE
experts, SGLang's AMX refusal) stays in its ``describe`` module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import EngineError
from .vllm.layout import ParamSpec, Shard

__all__ = ["KIND_OF_DTYPE", "ParallelLayers", "fused_parts", "layer_spec", "quantized_method"]

#: Parameter dtypes the extensions read in place → the served element kind.
KIND_OF_DTYPE = {"torch.bfloat16": "bf16", "torch.float16": "f16", "torch.float32": "f32"}

_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "NoneType")


@dataclass(frozen=True)
class ParallelLayers:
    """One engine's parallel layer classes (imported inside that engine's process)."""

    linear: type[Any]  # LinearBase
    qkv: type[Any]
    merged: type[Any]  # MergedColumnParallelLinear
    column: type[Any]
    row: type[Any]
    vocab: type[Any]  # VocabParallelEmbedding


def quantized_method(layers: ParallelLayers, mod: Any) -> str | None:
    """The quantization method's class name of a quantized parallel layer (None: plain)."""
    if not isinstance(mod, (layers.linear, layers.vocab)):
        return None
    method = type(getattr(mod, "quant_method", None)).__name__
    return None if method in _UNQUANTIZED else method


def fused_parts(
    packed: Mapping[str, Sequence[str]], pname: str, n: int, *, table: str
) -> list[str]:
    """The ``n`` checkpoint tensors a fused parameter ``pname`` stacks, in order, from the
    engine's table (fused module name → checkpoint module names; ``table`` names it)."""
    mod_name, _, leaf = pname.rpartition(".")
    prefix, _, last = mod_name.rpartition(".")
    subs = list(packed.get(last, []))
    if len(subs) != n:
        raise EngineError(
            f"{table} does not name this fused module's parts",
            param=pname,
            parts=subs,
            expected=n,
        )
    return [f"{prefix}.{s}.{leaf}" if prefix else f"{s}.{leaf}" for s in subs]


def layer_spec(
    layers: ParallelLayers,
    mod: Any,
    pname: str,
    shape: tuple[int, ...],
    packed: Mapping[str, Sequence[str]],
    *,
    table: str,
) -> ParamSpec | None:
    """The spec of parameter ``pname`` (of ``shape``) of a parallel layer ``mod``; None when
    ``mod`` is none of the engine's parallel layers (the caller decides: replicated, or
    refused)."""
    leaf = pname.rpartition(".")[2]
    cols = shape[1:]
    if isinstance(mod, layers.qkv):
        q, k, v = fused_parts(packed, pname, 3, table=table)
        hd, vhd = mod.head_size, getattr(mod, "v_head_size", mod.head_size)
        rep = mod.num_kv_head_replicas
        return ParamSpec(
            pname,
            "column",
            (
                Shard(q, (mod.total_num_heads * hd, *cols), mod.num_heads * hd),
                Shard(k, (mod.total_num_kv_heads * hd, *cols), mod.num_kv_heads * hd, rep),
                Shard(v, (mod.total_num_kv_heads * vhd, *cols), mod.num_kv_heads * vhd, rep),
            ),
        )
    if isinstance(mod, layers.merged):
        names = fused_parts(packed, pname, len(mod.output_sizes), table=table)
        return ParamSpec(
            pname,
            "column",
            tuple(Shard(n, (int(size), *cols)) for n, size in zip(names, mod.output_sizes)),
        )
    if isinstance(mod, layers.column):
        return ParamSpec(pname, "column", (Shard(pname, (int(mod.output_size), *cols)),))
    if isinstance(mod, layers.row):
        if leaf != "weight":  # the bias is whole on every rank (added once, on rank 0)
            return ParamSpec(pname, "replicated", (Shard(pname, shape),))
        return ParamSpec(pname, "row", (Shard(pname, (shape[0], int(mod.input_size))),))
    if isinstance(mod, layers.vocab):
        if mod.num_added_embeddings:
            raise EngineError(
                "added (LoRA) vocabulary is not supported", module=pname.rpartition(".")[0]
            )
        return ParamSpec(
            pname,
            "vocab",
            (Shard(pname, (int(mod.org_vocab_size), *cols)),),
            padded=int(mod.num_embeddings_padded),
        )
    return None
