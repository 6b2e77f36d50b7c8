"""Run an ASGI app under uvicorn in a background thread (engines, sidecars, relays, gateways).

One owner for how a rollpatch service faces its clients (:class:`ServeOptions`):

- **TLS** (``tls_cert``/``tls_key``): loaded, and refused with a clear :class:`ConfigError`,
  before the server starts; TLS 1.2 at least.
- **Slow clients**: a connection must deliver a complete request head within
  ``header_timeout_s`` of connecting (or of its first byte after a keep-alive pause), else it
  gets ``408`` and is closed; heads over ``max_header_bytes`` are refused. Bodies have their own
  bound where they are read (:class:`~rollpatch.serving.body.BodyLimits`). Past
  ``max_connections`` open connections, requests get ``503`` instead of queueing.
- **Bearer token** (``token``): requests to the protected route prefixes (``/v1/``: inference,
  relay reads) need ``Authorization: Bearer TOKEN`` (``401`` otherwise, compared in constant
  time); health, readiness and metrics stay open.

- **Lifecycle**: the app's lifespan runs (``lifespan="auto"``), so what an app opens at build
  time (its upstream HTTP client) is closed when the server stops.
- **Event loop** (``loop``): asyncio's by default; ``"fast"`` runs uvloop when it is installed
  (the ``web`` extra installs it), asyncio's otherwise. A proxy's hot path (the sidecar)
  pays a loop wake-up per streamed event: uvloop costs about a third less CPU per request.
- **HTTP parser** (``http``): h11 by default; ``"fast"`` runs httptools when it is installed
  (the ``web`` extra installs it), h11 otherwise, with the same slow-client guards
  (:mod:`.protocols`). The sidecar runs on both fast options.

uvicorn is imported only when a server starts (the ``web`` extra).
"""

from __future__ import annotations

import hmac
import importlib.util
import json
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..config import check_fields, setting
from ..errors import ConfigError, RollpatchError
from .protocols import HttpKind, guarded_protocol
from .protocols import no_delay as _no_delay  # noqa: F401  (its old home; tests import it)

__all__ = [
    "PROTECTED",
    "HttpKind",
    "LoopKind",
    "ServeOptions",
    "ServerHandle",
    "serve_app",
    "tls_context",
]

#: The event loop a server runs on: asyncio's, or uvloop when installed (``"fast"``).
LoopKind = Literal["asyncio", "fast"]

#: Route prefixes a bearer token protects by default (inference; relay reads).
PROTECTED = ("/v1/",)


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """How a service faces its clients (validated; see the module docstring)."""

    #: Both or neither (then plain HTTP).
    tls_cert: str | None = setting(None, help="PEM certificate chain")
    tls_key: str | None = setting(None, help="the certificate's PEM private key")
    token: str | None = setting(None, help="bearer token required on the protected routes")
    header_timeout_s: float = setting(
        10.0,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="seconds a client may take to send a complete request head",
    )
    #: Longer than clients keep idle connections (httpx and the openai client: 5 s; our
    #: pooled upstream client: 5 s): a server that closes an idle connection at the moment a
    #: client reuses it makes that request fail (ReadError); uvicorn's default of 5 s equals
    #: httpx's.
    keep_alive_s: float = setting(
        65.0, lo=0.0, lo_open=True, hi=3600.0, help="seconds an idle keep-alive connection is kept"
    )
    max_header_bytes: int = setting(
        64 * 1024, lo=1024, hi=1 << 24, help="largest request head in bytes"
    )
    max_connections: int | None = setting(
        2048, lo=1, help="open connections above which requests are answered 503"
    )

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                "tls_cert and tls_key go together",
                field="tls_cert",
                hint="--tls-cert FILE --tls-key FILE",
            )
        check_fields(self)
        if self.token is not None and (
            not self.token
            or not self.token.isascii()
            or not self.token.isprintable()
            or " " in self.token
        ):
            raise ConfigError(
                "token must be non-empty printable ASCII without spaces", field="token"
            )

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"


def tls_context(options: ServeOptions) -> ssl.SSLContext | None:
    """The server's TLS context (None without TLS); ConfigError when the files do not load."""
    if options.tls_cert is None or options.tls_key is None:
        return None
    for name, path in (("tls_cert", options.tls_cert), ("tls_key", options.tls_key)):
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{name}: no such file", field=name, path=path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(options.tls_cert, options.tls_key)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise ConfigError(
            f"cannot load the TLS certificate and key: {e}",
            field="tls_cert",
            hint="PEM files: a certificate (chain) and its private key",
        ) from None
    return ctx


class _BearerGuard:
    """ASGI middleware: the protected prefixes need ``Authorization: Bearer TOKEN``."""

    def __init__(
        self, app: Callable[..., Awaitable[None]], token: str, prefixes: tuple[str, ...]
    ) -> None:
        self.app, self.prefixes = app, prefixes
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")).startswith(self.prefixes):
            given = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    given = value
                    break
            if not hmac.compare_digest(given, self.expected):
                body = json.dumps(
                    {
                        "error": {
                            "message": "this route needs the bearer token "
                            "(Authorization: Bearer TOKEN)",
                            "type": "unauthorized",
                            "code": 401,
                        }
                    }
                ).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _loop_name(kind: LoopKind) -> str:
    """uvicorn's name for the loop of ``kind``."""
    if kind == "fast" and importlib.util.find_spec("uvloop") is not None:
        return "uvloop"
    return "asyncio"


class ServerHandle:
    """A running server: ``url`` (``http(s)://host:port``), :meth:`stop`, :meth:`wait`."""

    def __init__(self, server: Any, thread: threading.Thread, url: str) -> None:
        self._server, self._thread, self.url = server, thread, url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        """Whether the server's thread still runs."""
        return self._thread.is_alive()

    def request_stop(self) -> None:
        """Ask uvicorn to exit (safe from a signal handler)."""
        self._server.should_exit = True

    def wait(self) -> None:
        """Block until the server's thread ends."""
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for its thread."""
        self._server.should_exit = True
        self._thread.join(timeout)


def serve_app(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    name: str = "server",
    log_level: str = "warning",
    start_timeout: float = 30.0,
    lifespan: Literal["auto", "on", "off"] = "auto",
    options: ServeOptions | None = None,
    protect: tuple[str, ...] = PROTECTED,
    access_log: bool = False,
    loop: LoopKind = "asyncio",
    http: HttpKind = "h11",
) -> ServerHandle:
    """Serve ``app`` in a daemon thread; ``port=0`` picks a free port. Returns once listening.

    ``options`` adds TLS, the bearer token on ``protect``-ed prefixes and the slow-client
    bounds; a bad certificate or key raises :class:`ConfigError` before anything listens.
    ``lifespan="auto"`` runs the app's lifespan when it has one (startup before the first
    request, shutdown on :meth:`ServerHandle.stop`: where the sidecar and the gateway close
    their upstream clients). ``loop`` and ``http``: see the module docstring.
    """
    import uvicorn

    if loop not in ("asyncio", "fast"):
        raise ConfigError("loop must be 'asyncio' or 'fast'", field="loop", value=loop)
    if http not in ("h11", "fast"):
        raise ConfigError("http must be 'h11' or 'fast'", field="http", value=http)
    opts = options or ServeOptions()
    ctx = tls_context(opts)
    if opts.token is not None:
        app = _BearerGuard(app, opts.token, protect)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    tls: dict[str, Any] = (
        {}
        if ctx is None
        else {
            "ssl_certfile": opts.tls_cert,
            "ssl_keyfile": opts.tls_key,
            "ssl_context_factory": lambda _config, _default: ctx,
        }
    )
    config = uvicorn.Config(
        app,
        # no handlers of its own: its lines go through rollpatch.logs.configure's (the
        # service's --log-format), or Python's last resort in a library process
        log_config=None,
        log_level=log_level,
        lifespan=lifespan,
        access_log=access_log,
        timeout_graceful_shutdown=2,
        http=guarded_protocol(http, opts.header_timeout_s, opts.max_header_bytes),
        loop=_loop_name(loop),
        timeout_keep_alive=int(max(1, round(opts.keep_alive_s))),
        h11_max_incomplete_event_size=opts.max_header_bytes,
        limit_concurrency=opts.max_connections,
        **tls,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"rollpatch-{name}-{bound}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RollpatchError(f"{name} server did not start", host=host, port=bound)
        time.sleep(0.01)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return ServerHandle(server, thread, f"{opts.scheme}://{shown}:{bound}")
