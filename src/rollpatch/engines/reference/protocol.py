"""The OpenAI wire shapes the reference server speaks: request models, logprobs, text.

Pydantic lives here, at the HTTP boundary only. Extensions follow vLLM: ``return_token_ids``
(``prompt_token_ids`` + per-choice ``token_ids``), ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ...errors import ConfigError
from .runtime import Step

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "StreamOptions",
    "TextStream",
    "chat_logprobs",
    "completion_logprobs",
    "encode_routed_experts",
    "error_body",
]


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` is meaningful here."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, ...) are ignored
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    #: vLLM's: skip the first N prompt tokens of the returned ``routed_experts`` (MoE).
    routed_experts_prompt_start: int = Field(default=0, ge=0)

    def stops(self) -> list[str]:
        """Stop strings as a list (empty strings dropped)."""
        raw = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in raw if s]

    def check_common(self) -> None:
        """Reject what the reference engine does not implement (400, naming the field)."""
        if self.n != 1:
            raise ConfigError("only n=1 is supported", field="n")
        if len(self.stops()) > 4:
            raise ConfigError("at most 4 stop strings", field="stop")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt (text or token ids), legacy integer logprobs."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompt_input(self) -> str | list[int]:
        """The single prompt, as text or token ids; batches are rejected."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ConfigError(
                    "batched prompts are not supported; send one prompt", field="prompt"
                )
            p = p[0]
        if self.echo:
            raise ConfigError("echo=true is not supported", field="echo")
        return p  # type: ignore[return-value]


class ChatMessage(BaseModel):
    """One chat message; content may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ConfigError("only text content parts are supported", field="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def token_budget(self, default: int) -> int:
        """``max_completion_tokens`` (new name) or ``max_tokens`` (old), else ``default``."""
        for v in (self.max_completion_tokens, self.max_tokens):
            if v is not None:
                return v
        return default

    def logprobs_k(self) -> int | None:
        """How many top logprobs to compute (None when logprobs are off)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ConfigError("top_logprobs requires logprobs=true", field="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def encode_routed_experts(rows: Any) -> str:
    """vLLM's wire form of ``routed_experts``: base64 of the array's ``.npy`` bytes (no
    pickle); decode with ``np.load(io.BytesIO(base64.b64decode(s)))``."""
    import base64
    import io

    import numpy as np

    with io.BytesIO() as buf:
        np.save(buf, rows, allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: int | str | None = None,
) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class TextStream:
    """Incremental detokenizer with stop strings.

    Decodes only a short window per token (prefix/read offsets, as vLLM and TGI do), holds
    back incomplete UTF-8, truncates at the first stop string, and in streaming mode holds
    back text that could still become a stop string.
    """

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""
        self.stops = stops
        self.stopped = False
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def add(self, token_id: int) -> int:
        """Feed one token; returns the text offset where it starts. Sets ``stopped``."""
        offset = len(self.text)
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            start = max(0, len(self.text) - self._hold)
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
            for s in self.stops:
                i = self.text.find(s, start)
                if i >= 0:
                    self.text, self.stopped = self.text[:i], True
                    break
        return offset

    def delta(self, final: bool) -> str:
        """Text not yet streamed; all of it when ``final`` or stopped, else minus the hold."""
        end = len(self.text) if final or self.stopped else max(0, len(self.text) - self._hold)
        end = max(end, self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out


def _piece(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def completion_logprobs(tokenizer: Any, steps: list[Step], offsets: list[int]) -> dict[str, Any]:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    return {
        "tokens": [_piece(tokenizer, s.token_id) for s in steps],
        "token_logprobs": [s.logprob for s in steps],
        "top_logprobs": [
            {_piece(tokenizer, t): lp for t, lp in (s.top_logprobs or [])} for s in steps
        ],
        "text_offset": offsets,
    }


def _chat_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    piece = _piece(tokenizer, token_id)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, steps: list[Step]) -> dict[str, Any]:
    """Chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    content = []
    for s in steps:
        entry = _chat_entry(tokenizer, s.token_id, s.logprob if s.logprob is not None else 0.0)
        entry["top_logprobs"] = [_chat_entry(tokenizer, t, lp) for t, lp in s.top_logprobs or []]
        content.append(entry)
    return {"content": content}
