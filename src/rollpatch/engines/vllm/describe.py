"""Read a loaded vLLM model's own metadata into rank-independent :class:`ParamSpec` s.

Runs inside a vLLM worker (imports vLLM and torch lazily). Everything comes from the model:
``packed_modules_mapping`` names the checkpoint tensors a fused module stacks, in order;
``QKVParallelLinear`` gives head counts and sizes (and KV-head replicas when TP exceeds the
KV heads); ``MergedColumnParallelLinear.output_sizes`` the fused row blocks; the layer class
the split (column / row / vocabulary / replicated); ``VocabParallelEmbedding`` its padding.
Each derived per-rank shape is cross-checked against the parameter vLLM allocated, and the
vocabulary placement against the layer's own ``shard_indices``, so an unknown layout fails
loudly at build time instead of writing wrong bits later.

Supported: unquantized BF16/F16/F32 parameters of Llama-family decoders (dense linear,
embedding, norm layers). Refused with a clear error: quantized methods (FP8, INT4...), added
(LoRA) vocabulary, MoE expert tensors, and models whose checkpoint names vLLM rewrites beyond
``packed_modules_mapping``.
"""

from __future__ import annotations

from typing import Any

from ...errors import EngineError
from ...kinds import Kind, get_kind
from .layout import ParamSpec, Shard, param_shape, placements

__all__ = ["describe"]

_KIND_OF_DTYPE = {"torch.bfloat16": "bf16", "torch.float16": "f16", "torch.float32": "f32"}


def _unquantized(module: Any, name: str) -> None:
    method = type(getattr(module, "quant_method", None)).__name__
    if method not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "NoneType"):
        raise EngineError("quantized layers are not supported by the vLLM extension yet",
                          module=name, quant_method=method,
                          hint="serve the bf16 format (FP8 status: docs/vllm.md)")


def _shape(p: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in p.shape)


def _spec(model: Any, pname: str, p: Any, packed: dict[str, list[str]], tp: int
          ) -> ParamSpec:
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    mod_name, _, leaf = pname.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    prefix, _, last = mod_name.rpartition(".")
    shape = _shape(p)
    cols = shape[1:]

    def ckpt(sub: str) -> str:
        return f"{prefix}.{sub}.{leaf}" if prefix else f"{sub}.{leaf}"

    def fused(n: int) -> list[str]:
        subs = packed.get(last, [])
        if len(subs) != n:
            raise EngineError("packed_modules_mapping does not name this fused module's parts",
                              param=pname, parts=subs, expected=n)
        return [ckpt(s) for s in subs]

    if isinstance(mod, (LinearBase, VocabParallelEmbedding)):
        _unquantized(mod, mod_name)
    if isinstance(mod, QKVParallelLinear):
        q, k, v = fused(3)
        hd, vhd = mod.head_size, getattr(mod, "v_head_size", mod.head_size)
        rep = mod.num_kv_head_replicas
        return ParamSpec(pname, "column", (
            Shard(q, (mod.total_num_heads * hd, *cols), mod.num_heads * hd),
            Shard(k, (mod.total_num_kv_heads * hd, *cols), mod.num_kv_heads * hd, rep),
            Shard(v, (mod.total_num_kv_heads * vhd, *cols), mod.num_kv_heads * vhd, rep)))
    if isinstance(mod, MergedColumnParallelLinear):
        names = fused(len(mod.output_sizes))
        return ParamSpec(pname, "column", tuple(
            Shard(n, (int(size), *cols)) for n, size in zip(names, mod.output_sizes)))
    if isinstance(mod, ColumnParallelLinear):
        return ParamSpec(pname, "column", (Shard(pname, (int(mod.output_size), *cols)),))
    if isinstance(mod, RowParallelLinear):
        if leaf != "weight":  # the bias is whole on every rank (added once, on rank 0)
            return ParamSpec(pname, "replicated", (Shard(pname, shape),))
        return ParamSpec(pname, "row", (Shard(pname, (shape[0], int(mod.input_size))),))
    if isinstance(mod, VocabParallelEmbedding):
        if mod.num_added_embeddings:
            raise EngineError("added (LoRA) vocabulary is not supported", module=mod_name)
        return ParamSpec(pname, "vocab", (Shard(pname, (int(mod.org_vocab_size), *cols)),),
                         padded=int(mod.num_embeddings_padded))
    if getattr(mod, "tp_size", 1) > 1 and not isinstance(mod, LinearBase):
        raise EngineError("unknown tensor-parallel module", module=mod_name,
                          cls=type(mod).__name__)
    return ParamSpec(pname, "replicated", (Shard(pname, shape),))


def _whole_on_every_rank(spec: ParamSpec, tp: int) -> ParamSpec:
    """A layer built with ``disable_tp``: every rank holds every shard whole."""
    if spec.kind != "column":
        return ParamSpec(spec.param, "replicated", (Shard(spec.param, spec.shards[0].shape),))
    return ParamSpec(spec.param, "column", tuple(
        Shard(s.name, s.shape, s.rows, tp) for s in spec.shards))


def _check(mod: Any, spec: ParamSpec, p: Any, rank: int, tp: int) -> None:
    want = param_shape(spec, tp)
    got = _shape(p)
    flat = (got[0] if got else 1, int(p.numel()) // (got[0] if got and got[0] else 1))
    if want != flat:
        raise EngineError("derived parameter shape differs from vLLM's", param=spec.param,
                          derived=want, actual=got, hint="unsupported layout for this model")
    if spec.kind == "vocab":
        idx = mod.shard_indices
        pl = placements(spec, rank, tp)[0]
        if (pl.src_start, pl.src_start + pl.length) != (idx.org_vocab_start_index,
                                                        idx.org_vocab_end_index):
            raise EngineError("vocabulary placement differs from vLLM's shard indices",
                              param=spec.param)


def describe(model: Any, rank: int, tp: int) -> tuple[list[ParamSpec], dict[str, Kind]]:
    """Specs and element kinds of every (deduplicated) parameter of ``model``."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    specs: list[ParamSpec] = []
    kinds: dict[str, Kind] = {}
    for pname, p in model.named_parameters():
        if p.is_meta or p.numel() == 0:
            raise EngineError("parameter has no data (was its weight removed after loading?)",
                              param=pname, hint="load the extension with "
                              "--worker-extension-cls before the model loads")
        kind = _KIND_OF_DTYPE.get(str(p.dtype))
        if kind is None:
            raise EngineError("unsupported parameter dtype", param=pname, dtype=str(p.dtype),
                              hint="serve the bf16 format (FP8 status: docs/vllm.md)")
        spec = _spec(model, pname, p, packed, tp)
        mod_name = pname.rpartition(".")[0]
        mod = model.get_submodule(mod_name) if mod_name else model
        if tp > 1 and getattr(mod, "tp_size", tp) == 1 and spec.kind != "replicated":
            spec = _whole_on_every_rank(spec, tp)
        _check(mod, spec, p, rank, tp)
        specs.append(spec)
        kinds[pname] = get_kind(kind)
    return specs, kinds
