"""An OpenAI-compatible HTTP app over a :class:`ReferenceRuntime`, plus admin routes.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when
``stream``), ``GET /health``, and the admin routes the adapter/sidecar use on the same host:
``POST /rollpatch/pause``, ``POST /rollpatch/resume``, ``GET /rollpatch/state``. Every
response (and the last stream chunk) carries ``"rollpatch": {"version_start", "version_end"}``.
Errors are OpenAI-style JSON: 400 for bad requests, 404 unknown model/route, 503 not ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from ...errors import ConfigError, EngineError, RollpatchError
from ...serving import ServerHandle, serve_app
from .http_errors import UnknownModel, install_errors
from .protocol import (
    ChatRequest,
    CompletionRequest,
    TextStream,
    chat_logprobs,
    completion_logprobs,
    encode_routed_experts,
    error_body,
)
from .runtime import Generation, ReferenceRuntime, Step

__all__ = ["ServerHandle", "create_app", "serve"]

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """One request's generation plus everything needed to format its responses."""

    chat: bool
    gen: Generation
    text: TextStream
    k: int | None
    return_ids: bool
    include_usage: bool
    model: str
    #: MoE: return routing (``routed_experts``) from this prompt position; None = dense.
    prompt_start: int | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    steps: list[Step] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def run(self) -> Iterator[tuple[Step, int]]:
        """Drive the generation: yields (step, text offset); stops at a stop string."""
        try:
            for step in self.gen:
                offset = self.text.add(step.token_id)
                self.steps.append(step)
                self.offsets.append(offset)
                yield step, offset
                if self.text.stopped:
                    break
        finally:
            self.gen.close()
        self.finish_reason = "stop" if self.text.stopped else self.gen.finish_reason

    def head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> dict[str, int]:
        p, c = len(self.gen.prompt_token_ids), len(self.steps)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def versions(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version_start": self.gen.version_start,
            "version_end": self.gen.version_end,
        }
        if self.prompt_start is not None:  # which version routed which rows (pause mode)
            out["spans"] = self.gen.routed_spans(self.prompt_start)
        return out

    def routing(self, choice: dict[str, Any]) -> None:
        """Add ``routed_experts`` to a (final) choice, as vLLM does (MoE models only)."""
        if self.prompt_start is not None:
            rows = self.gen.routed_experts(self.prompt_start)
            choice["routed_experts"] = None if rows is None else encode_routed_experts(rows)


def _check_model(runtime: ReferenceRuntime, name: str | None) -> None:
    if name is not None and name != (served := runtime.model_name):
        why = f"This engine serves `{served}` (its model directory's name; GET /v1/models)."
        raise UnknownModel(f"The model `{name}` does not exist. {why}", served=served)


def _start(runtime: ReferenceRuntime, req: CompletionRequest | ChatRequest) -> _Job:
    """Validate, tokenize and start one generation (raises ConfigError → 400)."""
    _check_model(runtime, req.model)
    req.check_common()
    tok = runtime.tokenizer
    if isinstance(req, ChatRequest):
        if not getattr(tok, "chat_template", None):
            raise ConfigError("this model has no chat template", field="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError, TypeError, KeyError) as exc:  # caller's input
            raise ConfigError(f"chat template failed: {exc}", field="messages") from None
        ids = list(tok.encode(rendered, add_special_tokens=False))
        max_tokens, k = req.token_budget(runtime.max_model_len - len(ids)), req.logprobs_k()
    else:
        prompt = req.prompt_input()
        ids = list(tok.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        max_tokens, k = req.max_tokens if req.max_tokens is not None else 16, req.logprobs
    start = req.routed_experts_prompt_start
    if start > len(ids):
        raise ConfigError(
            "routed_experts_prompt_start must be between 0 and the prompt length",
            field="routed_experts_prompt_start",
            prompt_tokens=len(ids),
        )
    gen = runtime.generate(
        ids,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        logprobs=k,
        stop=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
    )
    include = bool(req.stream_options and req.stream_options.include_usage)
    return _Job(
        isinstance(req, ChatRequest),
        gen,
        TextStream(tok, req.stops()),
        k,
        req.return_token_ids,
        include,
        runtime.model_name,
        start if runtime.router is not None else None,
    )


async def _answered(request: Request, job: _Job, tok: Any) -> dict[str, Any]:
    """:func:`_complete` in a worker thread; a client that hangs up ends the generation at
    its next step (its slot and KV freed), as a stream's does."""
    gone = threading.Event()
    work = asyncio.ensure_future(run_in_threadpool(_complete, job, tok, gone))
    while not (await asyncio.wait({work}, timeout=0.1))[0]:
        if await request.is_disconnected():
            gone.set()
    return work.result()


def _complete(job: _Job, tok: Any, gone: threading.Event | None = None) -> dict[str, Any]:
    """Run to the end (or until the client is ``gone``) and build the non-streaming
    response."""
    steps = job.run()
    try:
        for _ in steps:
            if gone is not None and gone.is_set():
                break
    finally:
        steps.close()  # type: ignore[attr-defined]
    ids = [s.token_id for s in job.steps]
    choice: dict[str, Any] = {"index": 0, "finish_reason": job.finish_reason}
    if job.chat:
        body = job.head("chat.completion")
        choice["message"] = {"role": "assistant", "content": job.text.text}
        choice["logprobs"] = None if job.k is None else chat_logprobs(tok, job.steps)
        if job.return_ids:
            body["prompt_token_ids"] = job.gen.prompt_token_ids
            choice["token_ids"] = ids
    else:
        body = job.head("text_completion")
        choice["text"] = job.text.text
        choice["logprobs"] = (
            None if job.k is None else completion_logprobs(tok, job.steps, job.offsets)
        )
        if job.return_ids:
            choice["prompt_token_ids"] = job.gen.prompt_token_ids
            choice["token_ids"] = ids
    job.routing(choice)
    body.update(choices=[choice], usage=job.usage(), rollpatch=job.versions())
    return body


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _chunk(job: _Job, choice: dict[str, Any]) -> dict[str, Any]:
    body = job.head("chat.completion.chunk" if job.chat else "text_completion")
    body["choices"] = [choice]
    if job.include_usage:
        body["usage"] = None
    return body


async def _body(chunks: Iterator[str]) -> AsyncIterator[str]:
    """Drive the sync SSE generator in worker threads; close it when the client hangs up.

    Starlette does not close a sync iterator on disconnect; closing here ends the
    generation at once (its KV cache and in-flight slot are freed) instead of at GC.
    """
    try:
        while True:
            chunk = await run_in_threadpool(next, chunks, None)
            if chunk is None:
                return
            yield chunk
    finally:
        chunks.close()  # type: ignore[attr-defined]


def _stream(job: _Job, tok: Any) -> Iterator[str]:
    """SSE chunks: one per token, a finish chunk, an optional usage chunk, ``[DONE]``."""
    try:
        if job.chat:
            first = _chunk(
                job,
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                },
            )
            if job.return_ids:
                first["prompt_token_ids"] = job.gen.prompt_token_ids
            yield _sse(first)
        for i, (step, offset) in enumerate(job.run()):
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            delta = job.text.delta(final=False)
            if job.chat:
                choice["delta"] = {"content": delta}
                choice["logprobs"] = None if job.k is None else chat_logprobs(tok, [step])
            else:
                choice["text"] = delta
                choice["logprobs"] = (
                    None if job.k is None else completion_logprobs(tok, [step], [offset])
                )
                if job.return_ids and i == 0:
                    choice["prompt_token_ids"] = job.gen.prompt_token_ids
            if job.return_ids:
                choice["token_ids"] = [step.token_id]
            yield _sse(_chunk(job, choice))
        rest = job.text.delta(final=True)
        last: dict[str, Any] = {"index": 0, "finish_reason": job.finish_reason}
        if job.chat:
            last.update(delta={"content": rest} if rest else {}, logprobs=None)
        else:
            last.update(text=rest, logprobs=None)
        job.routing(last)  # vLLM does not stream routing; here it rides the finish chunk
        final = _chunk(job, last)
        if job.include_usage:
            yield _sse(final)
            final = job.head("chat.completion.chunk" if job.chat else "text_completion")
            final.update(choices=[], usage=job.usage())
        final["rollpatch"] = job.versions()
        yield _sse(final)
    except Exception as exc:  # headers are sent: report in-band (as vLLM does), keep the trace
        log.exception("generation failed mid-stream")
        yield _sse(error_body(f"{type(exc).__name__}: {exc}", "engine_error", code=500))
    yield "data: [DONE]\n\n"


def create_app(runtime: ReferenceRuntime) -> FastAPI:
    """The FastAPI app serving ``runtime``. Generation runs in worker threads (FastAPI runs
    the sync handlers there; the generation routes hand it to one themselves)."""
    app = FastAPI(title="rollpatch reference engine")
    install_errors(app)
    tok = runtime.tokenizer

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": runtime.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rollpatch",
                    "max_model_len": runtime.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(
        req: CompletionRequest, request: Request
    ) -> dict[str, Any] | StreamingResponse:
        job = await run_in_threadpool(_start, runtime, req)
        if req.stream:
            return StreamingResponse(_body(_stream(job, tok)), media_type="text/event-stream")
        return await _answered(request, job, tok)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatRequest, request: Request) -> dict[str, Any] | StreamingResponse:
        job = await run_in_threadpool(_start, runtime, req)
        if req.stream:
            return StreamingResponse(_body(_stream(job, tok)), media_type="text/event-stream")
        return await _answered(request, job, tok)

    # Admin routes are async and never block a worker thread: requests held at the gate may
    # occupy every thread of the pool, and resume must still get through.
    @app.post("/rollpatch/pause")
    async def pause(timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not runtime.pause(timeout=0):
            if time.monotonic() > deadline:
                raise EngineError(
                    "steps still in flight after the timeout",
                    timeout=timeout,
                    hint="retry; the gate stays closed",
                )
            await asyncio.sleep(0.002)
        return runtime.state()

    @app.post("/rollpatch/resume")
    async def resume() -> dict[str, Any]:
        runtime.resume()
        return runtime.state()

    @app.get("/rollpatch/state")
    async def state() -> dict[str, Any]:
        return runtime.state()

    return app


def serve(
    runtime: ReferenceRuntime,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    start_timeout: float = 30.0,
) -> ServerHandle:
    """Run :func:`create_app` under uvicorn in a daemon thread; ``port=0`` picks a free one."""
    try:
        return serve_app(
            create_app(runtime),
            host,
            port,
            name="reference",
            log_level=log_level,
            start_timeout=start_timeout,
        )
    except RollpatchError as e:
        raise EngineError("reference server did not start", host=host, port=port) from e
