"""Typed models of the request bodies the sidecar and the gateway accept (the HTTP boundary).

A body is first read within :class:`~rollpatch.serving.body.BodyLimits` and parsed as strict,
bounded JSON; then it is validated here: the OpenAI fields both services act on or that an
engine would choke on have types and ranges (a wrong one is a ``400`` that names the field,
before any admission slot or island is used); fields this model does not name pass through to
the engine untouched (engines grow options faster than we do). The same models are the request
schemas of the services' OpenAPI documents (what schemathesis fuzzes).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from ..errors import ConfigError

__all__ = [
    "MAX_MESSAGES",
    "ChatRequest",
    "CompletionRequest",
    "RollpatchField",
    "openapi_body",
    "validate_body",
]

_I63 = (1 << 63) - 1
#: Messages in one chat request (a multi-turn rollout holds far fewer).
MAX_MESSAGES = 16384
#: Token ids are vocabulary indices.
TokenId = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]
Version = Annotated[int, Field(ge=0, le=_I63)]


class RollpatchField(BaseModel):
    """``"rollpatch": {...}``: the version constraint (docs/sidecar.md)."""

    model_config = ConfigDict(extra="forbid")

    min_version: Version | None = None
    exact_version: Version | None = None
    max_lag: Version | None = None
    wait_s: Annotated[float, Field(ge=0, le=3600)] | None = None


class _Sampling(BaseModel):
    """Fields common to both routes; other fields pass through to the engine."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Annotated[str, Field(max_length=1024)] | None = None
    max_tokens: Annotated[int, Field(ge=0, le=1 << 24)] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1 << 24)] | None = None
    n: Annotated[int, Field(ge=1, le=256)] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), le=_I63)] | None = None
    stream: StrictBool | None = None
    stop: (
        Annotated[str, Field(max_length=4096)]
        | Annotated[list[Annotated[str, Field(max_length=4096)]], Field(max_length=64)]
        | None
    ) = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    rollpatch: RollpatchField | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Annotated[int, Field(ge=0, le=1024)] | None = None
    echo: StrictBool | None = None


class ChatMessage(BaseModel):
    """One chat message (content: text, or OpenAI content parts)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    #: Bounded: 200,000 one-letter messages (6.8 MB) cost an engine ~24 s of CPU in its chat
    #: template before its context-length 400 (found by an audit, session 39).
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=1024)] | None = None


#: The model of each proxied route.
ROUTES: dict[str, type[_Sampling]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}
Route = Literal["/v1/completions", "/v1/chat/completions"]


def _where(loc: tuple[int | str, ...]) -> str:
    """A field's path, without the tags pydantic gives the forms of a union (``str``,
    ``list[int]``, ``constrained-str``)."""
    parts = [str(p) for p in loc if isinstance(p, int) or not _is_form(str(p))]
    return ".".join(parts) or "body"


def _is_form(part: str) -> bool:
    return "[" in part or "-" in part or part in ("str", "int", "float", "bool", "list", "dict")


def validate_body(route: str, body: dict[str, Any]) -> _Sampling:
    """``body`` (already strict, bounded JSON) as the route's model; ConfigError (400) naming
    the first offending field otherwise."""
    try:
        return ROUTES[route].model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        # a field of several forms fails once per form: the error of the form the value has
        # (a bound it broke) says more than "should be a valid string" of the others
        first = next((x for x in errors if not str(x["type"]).endswith("_type")), errors[0])
        where = _where(first["loc"])
        fields = {_where(x["loc"]).split(".")[0] for x in errors}
        more = f" (and {len(fields) - 1} more fields)" if len(fields) > 1 else ""
        raise ConfigError(f"request body: {where}: {first['msg']}{more}", field=where) from None


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """Replace ``#/$defs/X`` references by their definitions (these models do not recurse)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def openapi_body(route: str) -> dict[str, Any]:
    """``openapi_extra`` for a route: its request schema, inlined, plus the refusals."""
    schema = ROUTES[route].model_json_schema()
    schema = _inline(schema, schema.get("$defs", {}))
    error = {"description": "refused", "content": {"application/json": {}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {str(s): error for s in (400, 401, 408, 409, 413, 502, 503)},
    }
