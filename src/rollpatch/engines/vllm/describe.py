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
embedding, norm layers) and of gated MoE blocks (``w13_weight``/``w2_weight`` of vLLM's
``RoutedExperts``: expert names from the layer's own ``get_expert_mapping``, the TP split and
the EP ``expert_map`` from its ``moe_config``; arithmetic in :mod:`.moe`). Refused with a clear
error: quantized methods (FP8, INT4...), added (LoRA) vocabulary, redundant (EPLB) or fused
shared experts, padded expert layouts, prepacked experts without a kept plain copy (vLLM's CPU
MoE kernel packs them; :mod:`.experts_cpu` keeps the plain words when the extension is loaded
before the model), expert parallelism across data-parallel ranks, and models whose checkpoint
names vLLM rewrites beyond ``packed_modules_mapping``.
"""

from __future__ import annotations

from typing import Any

from ...errors import EngineError
from ...kinds import Kind, get_kind
from ..layers import KIND_OF_DTYPE, ParallelLayers, layer_spec, quantized_method
from . import experts_cpu
from .layout import ParamSpec, Shard, param_shape, placements
from .moe import expert_spec

__all__ = ["describe"]


def _unquantized(layers: ParallelLayers, module: Any, name: str) -> None:
    method = quantized_method(layers, module)
    if method is not None:
        raise EngineError(
            "quantized layers are not supported by the vLLM extension yet",
            module=name,
            quant_method=method,
            hint="serve the bf16 format (FP8 status: docs/vllm.md)",
        )


def _shape(p: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in p.shape)


def _refuse_experts(mod: Any, mod_name: str, why: str, **ctx: Any) -> EngineError:
    return EngineError(
        f"MoE experts: {why}", module=mod_name, **ctx, hint="docs/vllm.md, Mixture of experts"
    )


def _expert_maps(mod: Any, mod_name: str, rank: int, tp: int) -> tuple[list[list[int]], int]:
    """(global expert → local slot, per rank; ranks the intermediate dim is split over)."""
    cfg = mod.moe_config
    par = cfg.moe_parallel_config
    experts = int(mod.global_num_experts)
    if not par.use_ep:
        if int(par.tp_size) != tp or int(par.tp_rank) != rank:
            raise _refuse_experts(
                mod,
                mod_name,
                "expert TP differs from the model's TP",
                moe_tp=int(par.tp_size),
                tp=tp,
            )
        return [list(range(experts)) for _ in range(tp)], tp
    if int(par.ep_size) != tp or int(par.ep_rank) != rank or int(par.tp_size) != 1:
        raise _refuse_experts(
            mod,
            mod_name,
            "expert parallelism over data-parallel ranks is not supported",
            ep_size=int(par.ep_size),
            tp=tp,
        )
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    maps = []
    for r in range(tp):
        _, m, _ = determine_expert_map(tp, r, experts, mod.expert_placement_strategy)
        maps.append([int(x) for x in m.tolist()] if m is not None else list(range(experts)))
    own = getattr(mod, "_expert_map", None)
    if own is not None and [int(x) for x in own.tolist()] != maps[rank]:
        raise _refuse_experts(
            mod,
            mod_name,
            "the layer's expert_map differs from vLLM's placement rule",
            strategy=str(mod.expert_placement_strategy),
        )
    return maps, 1


def _experts(mod: Any, mod_name: str, leaf: str, p: Any, rank: int, tp: int) -> ParamSpec:
    """A fused expert parameter of vLLM's ``RoutedExperts`` (see :mod:`.moe`)."""
    method = type(getattr(mod, "quant_method", None)).__name__
    if method != "UnquantizedFusedMoEMethod":
        raise _refuse_experts(
            mod, mod_name, "quantized experts are not supported yet", quant_method=method
        )
    kernel = getattr(
        getattr(getattr(mod, "quant_method", None), "moe_kernel", None), "fused_experts", None
    )
    if (
        "cpu" in type(kernel).__name__.lower()
        and not getattr(kernel, "_use_zentorch", False)  # zentorch reads the plain words
        and not experts_cpu.is_packed_experts(mod)
    ):
        raise _refuse_experts(mod, mod_name, experts_cpu.refusal(mod), kernel=type(kernel).__name__)
    cfg = mod.moe_config
    if leaf not in ("w13_weight", "w2_weight") or not cfg.is_act_and_mul:
        raise _refuse_experts(mod, mod_name, "only gated expert weights are supported", param=leaf)
    if cfg.num_experts != cfg.num_logical_experts or getattr(
        mod.expert_map_manager, "num_fused_shared_experts", 0
    ):
        raise _refuse_experts(mod, mod_name, "redundant (EPLB) or fused shared experts")
    if getattr(cfg, "tp_shard_with_padding", False) or getattr(mod, "lora_base_layer_prefix", ""):
        raise _refuse_experts(mod, mod_name, "padded or LoRA-wrapped experts")
    maps, expert_tp = _expert_maps(mod, mod_name, rank, tp)
    shard_ids = ("w1", "w3") if leaf == "w13_weight" else ("w2",)
    by_expert: dict[int, dict[str, str]] = {}
    for param_name, weight_name, expert, shard in mod.get_expert_mapping():
        if shard in shard_ids and param_name.rstrip("_").endswith(leaf.split("_")[0]):
            by_expert.setdefault(int(expert), {})[shard] = weight_name
    block = mod_name[: mod_name.index(".experts")] if ".experts" in mod_name else mod_name
    experts = int(mod.global_num_experts)
    if sorted(by_expert) != list(range(experts)) or any(
        set(v) != set(shard_ids) for v in by_expert.values()
    ):
        raise _refuse_experts(
            mod,
            mod_name,
            "the layer's expert mapping does not name every expert's tensors",
            found=len(by_expert),
            experts=experts,
        )
    names = [[f"{block}.{by_expert[e][s]}weight" for s in shard_ids] for e in range(experts)]
    hidden, size = (
        int(p.shape[2] if leaf == "w13_weight" else p.shape[1]),
        int((p.shape[1] // 2 if leaf == "w13_weight" else p.shape[2]) * expert_tp),
    )
    shape = (size, hidden) if leaf == "w13_weight" else (hidden, size)
    return expert_spec(
        f"{mod_name}.{leaf}",
        names,
        shape,
        maps,
        expert_tp=expert_tp,
        dim=0 if leaf == "w13_weight" else 1,
    )


def _spec(
    model: Any, pname: str, p: Any, packed: dict[str, list[str]], tp: int, rank: int = 0
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
    shape = _shape(p)

    if hasattr(mod, "moe_config") and hasattr(mod, "get_expert_mapping"):
        return _experts(mod, mod_name, leaf, p, rank, tp)
    layers = ParallelLayers(
        linear=LinearBase,
        qkv=QKVParallelLinear,
        merged=MergedColumnParallelLinear,
        column=ColumnParallelLinear,
        row=RowParallelLinear,
        vocab=VocabParallelEmbedding,
    )
    _unquantized(layers, mod, mod_name)
    spec = layer_spec(layers, mod, pname, shape, packed, table="packed_modules_mapping")
    if spec is not None:
        return spec
    if getattr(mod, "tp_size", 1) > 1 and not isinstance(mod, LinearBase):
        raise EngineError("unknown tensor-parallel module", module=mod_name, cls=type(mod).__name__)
    return ParamSpec(pname, "replicated", (Shard(pname, shape),))


def _whole_on_every_rank(spec: ParamSpec, tp: int) -> ParamSpec:
    """A layer built with ``disable_tp``: every rank holds every shard whole."""
    if spec.kind != "column":
        return ParamSpec(spec.param, "replicated", (Shard(spec.param, spec.shards[0].shape),))
    return ParamSpec(
        spec.param, "column", tuple(Shard(s.name, s.shape, s.rows, tp) for s in spec.shards)
    )


def _check(mod: Any, spec: ParamSpec, p: Any, rank: int, tp: int) -> None:
    want = param_shape(spec, tp)
    got = _shape(p)
    flat = (got[0] if got else 1, int(p.numel()) // (got[0] if got and got[0] else 1))
    if want != flat:
        raise EngineError(
            "derived parameter shape differs from vLLM's",
            param=spec.param,
            derived=want,
            actual=got,
            hint="unsupported layout for this model",
        )
    if spec.kind == "vocab":
        idx = mod.shard_indices
        pl = placements(spec, rank, tp)[0]
        if (pl.src_start, pl.src_start + pl.length) != (
            idx.org_vocab_start_index,
            idx.org_vocab_end_index,
        ):
            raise EngineError(
                "vocabulary placement differs from vLLM's shard indices", param=spec.param
            )


def describe(model: Any, rank: int, tp: int) -> tuple[list[ParamSpec], dict[str, Kind]]:
    """Specs and element kinds of every (deduplicated) parameter of ``model``."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    specs: list[ParamSpec] = []
    kinds: dict[str, Kind] = {}
    for pname, p in model.named_parameters():
        if p.is_meta or p.numel() == 0:
            raise EngineError(
                "parameter has no data (was its weight removed after loading?)",
                param=pname,
                hint="load the extension with --worker-extension-cls before the model loads",
            )
        kind = KIND_OF_DTYPE.get(str(p.dtype))
        if kind is None:
            raise EngineError(
                "unsupported parameter dtype",
                param=pname,
                dtype=str(p.dtype),
                hint="serve the bf16 format (FP8 status: docs/vllm.md)",
            )
        spec = _spec(model, pname, p, packed, tp, rank)
        mod_name = pname.rpartition(".")[0]
        mod = model.get_submodule(mod_name) if mod_name else model
        if (
            tp > 1
            and getattr(mod, "tp_size", tp) == 1
            and spec.kind not in ("replicated", "experts")
        ):
            spec = _whole_on_every_rank(spec, tp)
        _check(mod, spec, p, rank, tp)
        specs.append(spec)
        kinds[pname] = get_kind(kind)
    return specs, kinds
