"""``rollpatch relay``: serve a board read-only to a region, through a verified disk cache."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..config import parse_size
from ..errors import ConfigError
from ..logs import add_log_args

__all__ = ["RELAY_SET_OTHERWISE", "parse_size", "register"]

#: RelayConfig fields set another way: none, every field has its flag.
RELAY_SET_OTHERWISE: dict[str, str] = {}


def register(sub: Any) -> None:
    from ..relay import RelayConfig
    from .flags import add_config_flags
    from .serving import add_serving_args

    p = sub.add_parser(
        "relay",
        help="serve a board read-only to a region, with a verified disk cache (docs/relay.md)",
    )
    p.add_argument(
        "--board",
        required=True,
        help="upstream board URI: a path, file://, s3://, or http(s):// of another relay",
    )
    p.add_argument("--port", type=int, default=8470, help="TCP port; 0 picks a free one")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 to serve other machines)"
    )
    add_config_flags(p.add_argument_group("relay"), RelayConfig, skip=RELAY_SET_OTHERWISE)
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    from .trust import trust_args

    trust_args(p, default_state="CACHE/trust-state.json")
    p.add_argument(
        "--board-token-file",
        metavar="FILE",
        help="bearer token to send to an upstream relay that requires one",
    )
    add_serving_args(p, bodies=False, drain=True)
    add_log_args(p, default_level=None)
    p.set_defaults(func=cmd_relay)


def cmd_relay(args: argparse.Namespace) -> int:
    from . import preflight

    preflight.require_extra("web", "rollpatch relay")
    preflight.board_uri(args.board, existing=True)  # a relay only reads: no board created
    preflight.port_free(args.host, args.port)
    if Path(args.cache).exists() and not Path(args.cache).is_dir():
        raise ConfigError(f"--cache: {args.cache} is not a directory", hint="a directory to fill")
    _check_cache_dir(Path(args.cache), args.cache_bytes)
    from ..logs import configure

    configure(args.log_level, args.log_format, service="relay")
    from ..relay import RelayConfig, RelayServer
    from .flags import config_kwargs
    from .serving import ShutdownSignals, serve_options, upstream_store
    from .trust import load_trust

    trust = load_trust(args, args.board, state=Path(args.cache) / "trust-state.json")
    config = RelayConfig(**config_kwargs(args, RelayConfig))
    server = RelayServer(
        upstream_store(args.board, args.board_token_file, retried_by="client"),
        config,
        options=serve_options(args),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        trust=trust,
    )
    with ShutdownSignals() as signals:  # caught while it starts, too
        url = server.start()
        print(
            f"rollpatch relay: serving {args.board} at {url} (cache {args.cache}, "
            f"{config.cache_bytes:,} bytes)",
            flush=True,
        )
        try:
            signals.serve("relay", server.inflight, server.drain, args.shutdown_grace, server.alive)
        finally:
            server.stop()
    return 0


def _check_cache_dir(cache: Path, cache_bytes: int) -> None:
    """The cache directory can be written (a read-only or full one made every uncached read
    a 503 while /health said ok: found by an audit, session 38); a ``--cache-bytes`` larger
    than its filesystem is said once (the relay then evicts later than it should)."""
    import os
    import shutil
    import tempfile

    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, prefix=".write-check-") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ConfigError(
            f"--cache: cannot write to {cache}: {e.strerror or e}",
            hint="a writable directory with room for the cache (--cache-bytes)",
        ) from None
    total = shutil.disk_usage(cache).total
    if cache_bytes > total:
        print(
            f"rollpatch relay: warning: --cache-bytes {cache_bytes:,} exceeds the size of the "
            f"cache's filesystem ({total:,} bytes): the disk fills before the cache evicts",
            flush=True,
        )
