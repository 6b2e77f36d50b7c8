"""The built-in reference engine: a transformers causal LM on the CPU, served over HTTP.

Runs anywhere without a GPU. The model's parameters *are* the served view (no second copy),
so patches apply in place; generation pauses between forward passes for commits; an
OpenAI-compatible server reports the weight versions each response was produced under.

Needs the ``reference`` extra (torch, transformers, tokenizers, fastapi, uvicorn). Names are
imported lazily, so importing this package does not import torch until one is used::

    from rollpatch.engines.reference import ReferenceEngine, make_tiny_model
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import ReferenceEngine
    from .model import make_tiny_model, make_tiny_moe_model, make_tokenizer
    from .runtime import Generation, ReferenceRuntime, Step, bind_view
    from .server import ServerHandle, create_app, serve

__all__ = [
    "Generation",
    "ReferenceEngine",
    "ReferenceRuntime",
    "ServerHandle",
    "Step",
    "bind_view",
    "create_app",
    "make_tiny_model",
    "make_tiny_moe_model",
    "make_tokenizer",
    "serve",
]

_WHERE = {
    "ReferenceEngine": "adapter",
    "make_tiny_model": "model",
    "make_tiny_moe_model": "model",
    "make_tokenizer": "model",
    "Generation": "runtime",
    "ReferenceRuntime": "runtime",
    "Step": "runtime",
    "bind_view": "runtime",
    "ServerHandle": "server",
    "create_app": "server",
    "serve": "server",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
