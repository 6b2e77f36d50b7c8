"""Command-line options every rollpatch service shares: TLS, bearer tokens, slow-client bounds.

``add_serving_args(p)`` registers them; ``serve_options(args)`` turns them into a validated
:class:`~rollpatch.serving.ServeOptions` (a bad file or value is a :class:`ConfigError`: one
line, exit 2). ``upstream_store(board, token_file, retried_by=)`` opens a board, sending a bearer token when
it is a relay that requires one.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, final

from ..errors import ConfigError
from .flags import seconds, timeout_seconds
from .secrets import read_token

if TYPE_CHECKING:
    from ..serving import BodyLimits, ServeOptions
    from ..store import Store

__all__ = [
    "ShutdownSignals",
    "add_serving_args",
    "body_limits",
    "serve_options",
    "upstream_store",
]


def add_serving_args(
    p: argparse.ArgumentParser, *, bodies: bool = True, drain: bool = False
) -> None:
    """``--tls-cert/--tls-key``, ``--token-file``, ``--header-timeout`` (and
    ``--body-timeout``, ``--max-body-bytes`` for services that read request bodies;
    ``--shutdown-grace`` for those that drain on a signal: :class:`ShutdownSignals`)."""
    g = p.add_argument_group("serving (TLS, access, slow clients)")
    g.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate chain")
    g.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    g.add_argument(
        "--token-file",
        metavar="FILE",
        help="require 'Authorization: Bearer TOKEN' (the file's content) on /v1/ "
        "routes; health, readiness and metrics stay open",
    )
    from ..serving.server import ServeOptions

    head = ServeOptions().header_timeout_s  # the flags' defaults are the configs' own
    g.add_argument(
        "--header-timeout",
        type=timeout_seconds,
        default=head,
        metavar="S",
        help=f"seconds a client may take to send a request head (default {head:g})",
    )
    if bodies:
        from ..serving.body import BodyLimits

        defaults = BodyLimits()  # the flags' defaults are the config's own
        g.add_argument(
            "--body-timeout",
            type=timeout_seconds,
            default=defaults.timeout_s,
            metavar="S",
            help=f"seconds a client may take to send a request body (default {defaults.timeout_s:g})",
        )
        g.add_argument(
            "--max-body-bytes",
            type=int,
            default=defaults.max_bytes,
            metavar="N",
            help=f"largest request body accepted, in bytes (413 above it; default "
            f"{defaults.max_bytes:,}: {defaults.max_bytes / 2**20:g} MiB)",
        )
    if drain:
        g.add_argument(
            "--shutdown-grace",
            type=seconds,
            default=30.0,
            metavar="S",
            help="on SIGTERM/SIGINT, refuse new requests (503: they go elsewhere) and let "
            "those in flight, streams included, finish for up to S seconds; a second signal "
            "stops at once (default 30; 0: stop at once)",
        )


@final
class ShutdownSignals:
    """SIGTERM and SIGINT caught from ``__enter__`` on (before the service starts: a signal
    that arrives while it starts still gets a clean stop), the previous handlers put back on
    ``__exit__``; :meth:`serve` blocks until the first signal, then drains."""

    def __init__(self) -> None:
        self.done, self.hurry = threading.Event(), threading.Event()
        self._previous: dict[int, Any] = {}

    def _on_signal(self, *_: object) -> None:  # the first drains; a second cuts it short
        (self.hurry if self.done.is_set() else self.done).set()

    def __enter__(self) -> ShutdownSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def serve(
        self,
        name: str,
        inflight: Callable[[], int],
        drain: Callable[[float, threading.Event], bool],
        grace_s: float,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """Block until SIGTERM or SIGINT, then ``drain(grace_s, hurry)`` (refuse new requests,
        wait for those in flight) unless ``grace_s`` is 0; a second signal sets ``hurry``.
        Also returns, without a drain, once ``alive()`` is False (the server stopped by
        itself). The caller stops the service."""
        while not self.done.wait(0.5):
            if alive is not None and not alive():
                return
        from ..logs import event

        log = logging.getLogger(f"rollpatch.{name}")  # the log's lines beside stdout's
        if grace_s > 0:
            print(f"rollpatch {name}: draining {inflight()} request(s) in flight", flush=True)
            event(log, "draining", inflight=inflight(), grace_s=grace_s)
            if not drain(grace_s, self.hurry):
                print(
                    f"rollpatch {name}: stopping with {inflight()} request(s) in flight",
                    flush=True,
                )
                event(log, "drain_cut_short", logging.WARNING, inflight=inflight())
        event(log, "stopping")

    def finish(self, name: str, stop: Callable[[], None], bound_s: float) -> None:
        """Run ``stop`` (the service's own: its threads, its engine's close), bounded: an
        engine that does not answer must not keep the process alive. It gets ``bound_s``
        seconds, and 2 s more once a second signal came (a signal while it runs counts);
        past them the process exits at once with code 1, saying so."""
        failed: list[BaseException] = []

        def run() -> None:
            try:
                stop()
            except BaseException as e:  # noqa: BLE001 - raised again on this thread
                failed.append(e)

        t = threading.Thread(target=run, name=f"rollpatch-{name}-stop", daemon=True)
        t.start()
        deadline, hurried = time.monotonic() + bound_s, None
        while t.is_alive():
            t.join(0.1)
            now = time.monotonic()
            if hurried is None and self.hurry.is_set():
                hurried = now
            if t.is_alive() and (now > deadline or (hurried is not None and now > hurried + 2)):
                print(
                    f"rollpatch {name}: stopped without waiting for the engine (its calls did "
                    f"not finish within {now - deadline + bound_s:.0f} s)",
                    flush=True,
                )
                logging.shutdown()
                os._exit(1)
        if failed:
            raise failed[0]


def body_limits(args: argparse.Namespace) -> BodyLimits:
    """The validated :class:`~rollpatch.serving.BodyLimits` of ``--max-body-bytes`` and
    ``--body-timeout``."""
    from ..serving.body import BodyLimits

    return BodyLimits(max_bytes=args.max_body_bytes, timeout_s=args.body_timeout)


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The validated :class:`ServeOptions` the arguments describe."""
    from ..serving import ServeOptions, tls_context

    token = read_token(args.token_file, "--token-file file") if args.token_file else None
    options = ServeOptions(
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token=token,
        header_timeout_s=args.header_timeout,
    )
    tls_context(options)  # a bad certificate or key is refused before anything starts
    return options


def upstream_store(
    board: str, token_file: str | None, *, retried_by: Literal["client", "reader"]
) -> Store | str:
    """The board's store, sending the bearer token in ``token_file`` to a relay. A relay
    (``"client"``) keeps its relay or S3 client's own retries (``board`` itself when there is
    no token); a sidecar (``"reader"``) retries through its follower, so the client's are off
    (:func:`~rollpatch.store.open_reader_store`)."""
    from ..store import open_reader_store, open_store

    options: dict[str, Any] = {}
    if token_file is not None:
        if not board.startswith(("http://", "https://")):
            raise ConfigError(
                "a board token is for a relay (http:// or https:// board)", value=board
            )
        token = read_token(token_file, "--board-token-file file")
        options["headers"] = {"Authorization": f"Bearer {token}"}
    if retried_by == "reader":
        return open_reader_store(board, **options)
    return board if not options else open_store(board, **options)
