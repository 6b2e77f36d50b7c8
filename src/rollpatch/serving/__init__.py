"""The HTTP edge kit: how every rollpatch service (sidecar, gateway, relay, engines) faces its
clients.

- :mod:`.server`: run an ASGI app under uvicorn in a thread (TLS, bearer token, slow-client
  bounds, the app's lifespan run), :class:`ServeOptions`, :class:`ServerHandle`.
- :mod:`.body`: read a request body within :class:`BodyLimits` as strict, bounded JSON.
- :mod:`.schema`: typed request models of the OpenAI routes (pydantic; imported on use).
- :mod:`.responses`: OpenAI-style error bodies (fastapi; imported on use).
- :mod:`.upstream`: the hot path's pooled HTTP/1.1 client to one upstream (the sidecar's
  engine): asyncio protocols, bounded heads and chunk lines, no httpx on the way.
- :mod:`.app`: what a proxying app is built from: its upstream client (the one place its
  connection limits are written), the lifespan that closes it, the error handlers.
- :mod:`.admission`: a held slot released exactly once (:class:`~.admission.Slot`), blocking
  admission awaited without blocking the event loop (:func:`~.admission.admit_async`).
- :mod:`.streaming`: the SSE pass-through with its last event annotated
  (:class:`~.streaming.SseRelay`, :func:`~.streaming.relay_sse`), a streaming response
  that owns what it holds
  (:class:`~.streaming.OwnedStream`; fastapi, imported on use).
- :mod:`.metrics`: the Prometheus shapes services share (private registry, version gauges,
  outcome labels; ``prometheus_client``, imported on use).

Nothing here imports an engine, a follower or the codec, so a service that only routes (the
gateway) loads none of them. The web stack (uvicorn, fastapi, pydantic) is the ``web`` extra:
this package's top level imports none of it.
"""

from .body import BodyLimits, parse_json_object, read_body, read_json_object, refusal_status
from .server import PROTECTED, ServeOptions, ServerHandle, serve_app, tls_context

__all__ = [
    "PROTECTED",
    "BodyLimits",
    "ServeOptions",
    "ServerHandle",
    "parse_json_object",
    "read_body",
    "read_json_object",
    "refusal_status",
    "serve_app",
    "tls_context",
]
