"""Which master tensors a quantised format quantises (the rest are served as BF16)."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from ..errors import ConfigError

__all__ = ["QuantPolicy"]

_DEFAULT_SKIP = ("embed", "lm_head", "norm")


@dataclass(frozen=True, kw_only=True)
class QuantPolicy:
    """Name rules for quantisation.

    The format's own shape rule always applies on top (a tensor it cannot block, e.g. 1-D or
    K not divisible by the group size, stays BF16 even if a pattern names it).
    """

    #: fnmatch patterns (case-sensitive) of tensors to quantise; empty means the default rule:
    #: 2-D tensors whose name ends with ``.weight`` and whose lower-cased name contains none of
    #: ``embed``, ``lm_head``, ``norm``.
    include: tuple[str, ...] = ()
    #: fnmatch patterns (case-sensitive) of tensors never quantised; they win over ``include``.
    exclude: tuple[str, ...] = ()

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

    def quantise(self, name: str, shape: tuple[int, ...]) -> bool:
        """True if ``name`` (of ``shape``) should be quantised, before the format's shape rule."""
        if any(fnmatchcase(name, p) for p in self.exclude):
            return False
        if self.include:
            return any(fnmatchcase(name, p) for p in self.include)
        lowered = name.lower()
        return (
            len(shape) == 2
            and name.endswith(".weight")
            and not any(word in lowered for word in _DEFAULT_SKIP)
        )
