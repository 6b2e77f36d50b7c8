"""Errors an engine's own process reports (a vLLM worker, SGLang's extension) come back as
rollpatch exceptions: wrong bits keep their class, anything else is an EngineError."""

from __future__ import annotations

from rollpatch.errors import BaseMismatchError, EngineError, engine_error


def test_wrong_bits_keep_their_class_and_context() -> None:
    e = engine_error(
        {"type": "BaseMismatchError", "message": "old word differs", "context": {"tensor": "w"}},
        engine="vllm",
        what="worker",
    )
    assert type(e) is BaseMismatchError and e.message == "old word differs"
    assert e.context == {"tensor": "w", "engine": "vllm"}


def test_anything_else_is_an_engine_error_naming_it() -> None:
    for name in ("KeyError", "os", "engine_error"):  # never a class looked up by any name
        e = engine_error({"type": name, "message": "boom", "hint": "h"}, engine="sglang", what="X")
        assert type(e) is EngineError and e.message == f"X failed ({name}): boom"
        assert e.hint == "h" and e.context == {"engine": "sglang"}
