"""Which master tensors a quantised format quantises (the rest are served as BF16)."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from ..config import check_fields, setting
from ..errors import ConfigError

__all__ = ["QuantPolicy", "is_router"]

_DEFAULT_SKIP = ("embed", "lm_head", "norm")
#: Modules that hold a mixture-of-experts block's router as their ``gate``.
_MOE_BLOCKS = frozenset({"mlp", "block_sparse_moe", "moe", "feed_forward", "ffn"})


def is_router(name: str) -> bool:
    """True for a mixture-of-experts router tensor, by its checkpoint name: a segment
    ``router`` or ``shared_expert_gate``, or ``gate`` right after an MoE block (``mlp``,
    ``block_sparse_moe``, ``moe``, ``feed_forward``, ``ffn``).

    Qwen2/3-MoE, DeepSeek, GLM, Kimi: ``mlp.gate.weight`` (and DeepSeek's
    ``mlp.gate.e_score_correction_bias``); Mixtral: ``block_sparse_moe.gate.weight``;
    Qwen2-MoE: ``mlp.shared_expert_gate.weight``; GPT-OSS: ``mlp.router.weight``. A dense
    MLP's ``gate_proj`` is not a router.
    """
    segs = name.lower().split(".")
    return any(
        s in ("router", "shared_expert_gate") or (s == "gate" and i and segs[i - 1] in _MOE_BLOCKS)
        for i, s in enumerate(segs)
    )


@dataclass(frozen=True, kw_only=True)
class QuantPolicy:
    """Name rules for quantisation.

    The format's own shape rule always applies on top (a tensor it cannot block, e.g. 1-D or
    K not divisible by the group size, stays BF16 even if a pattern names it).

    Mixture-of-experts routers (:func:`is_router`) stay BF16 unless ``quantise_routers``, as
    quantised MoE checkpoints keep them: vLLM (0.32) builds the DeepSeek-V2/V3 (Kimi K2) and
    Mixtral gates with no quantisation config at all, and the usual recipes (llm-compressor's
    MoE examples: ``ignore=["lm_head", "re:.*mlp.gate$"]``) leave the Qwen-MoE gates out.
    """

    include: tuple[str, ...] = setting(
        (),
        metavar="GLOB",
        help="quantise only tensors matching this fnmatch pattern (repeatable; none given: "
        "2-D *.weight tensors but embeddings, lm_head and norms)",
    )
    """fnmatch patterns (case-sensitive) of tensors to quantise; empty means the default rule:
    2-D tensors whose name ends with ``.weight`` and whose lower-cased name contains none of
    ``embed``, ``lm_head``, ``norm``."""
    exclude: tuple[str, ...] = setting(
        (),
        metavar="GLOB",
        help="never quantise tensors matching this fnmatch pattern (repeatable; wins over "
        "--include)",
    )
    """fnmatch patterns (case-sensitive) of tensors never quantised; they win over ``include``."""
    quantise_routers: bool = setting(
        False,
        help="quantise mixture-of-experts routers too, when a rule picks them (off: "
        "routers stay BF16, as in real quantised MoE checkpoints)",
    )
    """Quantise MoE routers too, when a rule above picks them (default False: routers stay
    BF16 whatever ``include`` says, as in real quantised MoE checkpoints)."""

    def __post_init__(self) -> None:
        for field in ("include", "exclude"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(p, str) for p in value):
                raise ConfigError(
                    f"QuantPolicy.{field} must be a tuple of fnmatch patterns",
                    hint=f"e.g. {field}=('*.mlp.*',)",
                    value=value,
                )
            object.__setattr__(self, field, tuple(value))
        check_fields(self)

    def quantise(self, name: str, shape: tuple[int, ...]) -> bool:
        """True if ``name`` (of ``shape``) should be quantised, before the format's shape rule."""
        if any(fnmatchcase(name, p) for p in self.exclude):
            return False
        if not self.quantise_routers and is_router(name):
            return False
        if self.include:
            return any(fnmatchcase(name, p) for p in self.include)
        lowered = name.lower()
        return (
            len(shape) == 2
            and name.endswith(".weight")
            and not any(word in lowered for word in _DEFAULT_SKIP)
        )
