"""Read a loaded SGLang model's own metadata into checkpoint-coordinate layouts (in SGLang).

Runs inside SGLang's scheduler process (imports SGLang and torch lazily). Everything comes
from the model: ``stacked_params_mapping`` (SGLang's own weight-loading table) names the
checkpoint tensors a fused parameter stacks and their order (``q, k, v`` of ``qkv_proj``,
``0, 1`` of ``gate_up_proj``); ``QKVParallelLinear`` gives head counts and sizes (and KV-head
replicas), ``MergedColumnParallelLinear.output_sizes`` the fused row blocks, the layer class
the split (column / row / vocabulary / replicated), ``VocabParallelEmbedding`` its padding.
Every derived per-rank shape is checked against the parameter SGLang allocated.

The layouts are :class:`rollpatch.engines.vllm.layout.ParamSpec` s: SGLang's parallel layers
(adapted from vLLM's) split tensors the same way, and are read by the reader both extensions
share (:mod:`rollpatch.engines.layers`). Refused with a clear error: quantized
methods, weights repacked for Intel AMX (a derived copy the extension does not rebuild),
added vocabulary, and parameter dtypes other than BF16/F16/F32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import EngineError
from ...kinds import Kind, get_kind
from ..layers import KIND_OF_DTYPE, ParallelLayers, layer_spec, quantized_method
from ..vllm.layout import ParamSpec, Shard, param_shape

__all__ = ["DEFAULT_STACKED", "describe", "param_words"]

_WORDS = {2: ("int16", np.uint16), 4: ("int32", np.uint32)}
#: SGLang's Llama-family table, for models that do not carry one.
DEFAULT_STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def _packed(model: Any) -> dict[str, list[str]]:
    """Fused module name → checkpoint module names in stacking order."""
    table = getattr(model, "stacked_params_mapping", None) or DEFAULT_STACKED
    order = {"q": 0, "k": 1, "v": 2}
    parts: dict[str, list[tuple[int, str]]] = {}
    for entry in table:
        fused, part, shard = str(entry[0]), str(entry[1]), entry[2]
        idx = order[shard] if isinstance(shard, str) else int(str(shard))
        parts.setdefault(fused.strip("."), []).append((idx, part.strip(".")))
    return {k: [n for _, n in sorted(v)] for k, v in parts.items()}


def param_words(p: Any) -> np.ndarray:
    """The parameter's words as a writable 2-D numpy array sharing its memory (CPU)."""
    import torch

    if p.device.type != "cpu" or not p.is_contiguous():
        raise EngineError(
            "the SGLang extension reads parameters in place on the CPU only",
            device=str(p.device),
            hint="docs/sglang.md, status",
        )
    signed, unsigned = _WORDS[p.element_size()]
    rows = int(p.shape[0]) if p.dim() else 1
    words = p.detach().view(getattr(torch, signed)).numpy().view(unsigned)
    a = words.reshape(rows, int(p.numel()) // max(rows, 1))
    if a.size and a.__array_interface__["data"][0] != p.data_ptr():
        raise EngineError("parameter words do not alias the parameter")
    return a


def _layers() -> ParallelLayers:
    from sglang.srt.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return ParallelLayers(
        linear=LinearBase,
        qkv=QKVParallelLinear,
        merged=MergedColumnParallelLinear,
        column=ColumnParallelLinear,
        row=RowParallelLinear,
        vocab=VocabParallelEmbedding,
    )


def _spec(
    model: Any, pname: str, p: Any, packed: dict[str, list[str]], layers: ParallelLayers
) -> ParamSpec:
    mod_name = pname.rpartition(".")[0]
    mod = model.get_submodule(mod_name) if mod_name else model
    shape = tuple(int(d) for d in p.shape)
    method = quantized_method(layers, mod)
    if method is not None:
        raise EngineError(
            "quantized layers are not supported by the SGLang extension",
            module=mod_name,
            quant_method=method,
        )
    if getattr(mod, "use_intel_amx_backend", False):
        raise EngineError(
            "weights repacked for Intel AMX are not supported (the packed copy "
            "would not see in-place writes)",
            module=mod_name,
            hint="docs/sglang.md, status",
        )
    spec = layer_spec(layers, mod, pname, shape, packed, table="stacked_params_mapping")
    return spec if spec is not None else ParamSpec(pname, "replicated", (Shard(pname, shape),))


def describe(model: Any, tp: int) -> tuple[list[ParamSpec], dict[str, Kind], dict[str, Any]]:
    """Layouts, element kinds and torch parameters of every (deduplicated) parameter."""
    packed, layers = _packed(model), _layers()
    specs: list[ParamSpec] = []
    kinds: dict[str, Kind] = {}
    params: dict[str, Any] = {}
    for pname, p in model.named_parameters():
        kind = KIND_OF_DTYPE.get(str(p.dtype))
        if kind is None:
            raise EngineError(
                "unsupported parameter dtype",
                param=pname,
                dtype=str(p.dtype),
                hint="serve the bf16 format",
            )
        if p.is_meta or p.numel() == 0:
            raise EngineError("parameter has no data", param=pname)
        spec = _spec(model, pname, p, packed, layers)
        flat = (
            int(p.shape[0]) if p.dim() else 1,
            int(p.numel()) // (int(p.shape[0]) if p.dim() and p.shape[0] else 1),
        )
        if param_shape(spec, tp) != flat:
            raise EngineError(
                "derived parameter shape differs from SGLang's",
                param=pname,
                derived=param_shape(spec, tp),
                actual=tuple(p.shape),
                hint="unsupported layout for this model",
            )
        specs.append(spec)
        kinds[pname] = get_kind(kind)
        params[pname] = p
    return specs, kinds, params
