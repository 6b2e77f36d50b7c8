"""Mixture-of-experts in the reference engine: checkpoint names and routing capture.

transformers (v5) holds a sparse block's experts fused: ``experts.gate_up_proj`` of shape
``[E, 2·I, H]`` (gate rows, then up rows) and ``experts.down_proj`` of shape ``[E, H, I]``,
while checkpoints (and vLLM, and the served view) name one tensor per expert
(``experts.{e}.gate_proj.weight``). Every per-expert tensor is a contiguous slice of the fused
parameter, so :func:`split_experts` exposes it under its checkpoint name without a copy.

:class:`RouterTap` records the experts each router picked in each forward pass (the indices
the router returned, i.e. what the expert computation used), in vLLM's layout
(``routed_experts``: ``[tokens, moe_layers, top_k]``, uint8 up to 256 experts, else uint16).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError

__all__ = ["RouterTap", "checkpoint_name", "expert_names", "split_experts"]

#: Checkpoint layout families (transformers' ``conversion_mapping`` names them):
#: (gate name, up name, down name, runtime block name, checkpoint block name).
_FAMILIES: dict[str, tuple[str, str, str, str, str]] = {
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj", ".mlp.", ".mlp."),
    "mixtral": ("w1", "w3", "w2", ".mlp.", ".block_sparse_moe."),
}


def _family(model: Any) -> tuple[str, str, str, str, str] | None:
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as pattern
    except ImportError:  # older transformers hold experts per expert already
        pattern = {}
    return _FAMILIES.get(pattern.get(model_type, model_type))


def checkpoint_name(model: Any, name: str) -> str:
    """The checkpoint's name of a runtime tensor (Mixtral's block is ``block_sparse_moe``)."""
    fam = _family(model)
    if fam is None or fam[3] == fam[4] or fam[3] not in name:
        return name
    return name.replace(fam[3], fam[4], 1)


def expert_names(model: Any, name: str, experts: int) -> list[tuple[str, str, str]] | None:
    """Checkpoint names (gate, up, down) of each expert of the fused parameter ``name``."""
    fam = _family(model)
    if fam is None or not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return None
    gate, up, down, runtime, ckpt = fam
    prefix = name.rpartition(".")[0].replace(runtime, ckpt)
    return [
        (f"{prefix}.{e}.{gate}.weight", f"{prefix}.{e}.{up}.weight", f"{prefix}.{e}.{down}.weight")
        for e in range(experts)
    ]


def split_experts(model: Any, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """``[(checkpoint name, slice)]`` for a fused expert parameter, else None."""
    if t.dim() != 3:
        return None
    names = expert_names(model, name, int(t.shape[0]))
    if names is None:
        return None
    if name.endswith(".down_proj"):
        return [(n[2], t[e]) for e, n in enumerate(names)]
    if t.shape[1] % 2:
        raise ConfigError("fused gate_up_proj has an odd number of rows", tensor=name)
    half = int(t.shape[1]) // 2
    out: list[tuple[str, torch.Tensor]] = []
    for e, (g, u, _) in enumerate(names):
        out += [(g, t[e, :half]), (u, t[e, half:])]
    return out


def _routers(model: Any) -> list[torch.nn.Module]:
    """The model's router modules, in layer order (from the model's own output recorder)."""
    recorder = getattr(model, "_can_record_outputs", None) or {}
    rec = recorder.get("router_logits")
    cls = getattr(rec, "target_class", None)
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


class RouterTap:
    """Forward hooks on every router; :meth:`take` returns one forward pass's routing.

    Forward passes are serialized by the runtime's forward lock, so one buffer suffices.
    """

    def __init__(self, model: Any) -> None:
        routers = _routers(model)
        if not routers:
            raise ConfigError(
                "the model has no mixture-of-experts router to record",
                model_type=getattr(model.config, "model_type", None),
            )
        cfg = model.config
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
        self.experts = int(experts or 0)
        self.top_k = int(cfg.num_experts_per_tok)
        self.layers = len(routers)
        self.dtype = np.uint8 if self.experts <= 256 else np.uint16
        self._rows: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, _: Any, __: Any, out: Any) -> None:
        idx = out[2] if isinstance(out, tuple) and len(out) >= 3 else None
        if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point:
            raise ConfigError("the router does not return the chosen expert indices")
        self._rows.append(idx.reshape(-1, idx.shape[-1]))

    def start(self) -> None:
        self._rows.clear()

    def take(self) -> np.ndarray:
        """``[tokens, layers, top_k]`` of the forward pass since :meth:`start`."""
        if len(self._rows) != self.layers:
            raise ConfigError(
                "a forward pass did not run every router", seen=len(self._rows), layers=self.layers
            )
        rows = torch.stack(self._rows, dim=1).to(torch.int64).numpy()
        self._rows.clear()
        return rows.astype(self.dtype)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def spans(versions: list[tuple[int, int | None]]) -> Iterator[dict[str, int | None]]:
    """``[(rows, version)]`` per forward pass → maximal ``{start, end, version}`` row spans."""
    start = 0
    cur: dict[str, int | None] | None = None
    for rows, version in versions:
        if cur is not None and cur["version"] == version:
            cur["end"] = start + rows
        else:
            if cur is not None:
                yield cur
            cur = {"start": start, "end": start + rows, "version": version}
        start += rows
    if cur is not None:
        yield cur
