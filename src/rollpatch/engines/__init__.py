"""Engine adapters: hold a served view inside a real engine (load, apply in place, digest).

Adapters import their engine inside their own module, so ``import rollpatch`` never needs
torch, vLLM or SGLang. :class:`ViewEngine` holds a view in this process (tests, ``pull``).
"""

from .base import EngineAdapter
from .view_engine import ViewEngine

__all__ = ["EngineAdapter", "ViewEngine"]
