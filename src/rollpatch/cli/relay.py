"""``rollpatch relay``: serve a board read-only to a region, through a verified disk cache."""

from __future__ import annotations

import argparse
import re
import signal
from pathlib import Path
from typing import Any

from ..logs import add_log_args

__all__ = ["parse_size", "register"]

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``"1000"``, ``"512M"``, ``"10G"``, ``"1.5TiB"`` (binary units)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 500M, 20G)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return value


def register(sub: Any) -> None:
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
    p.add_argument("--cache", required=True, help="cache directory (kept across restarts)")
    p.add_argument("--port", type=int, default=8470, help="TCP port; 0 picks a free one")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 to serve other machines)"
    )
    p.add_argument(
        "--cache-bytes",
        type=parse_size,
        default=10 << 30,
        help="disk cache bound, e.g. 200G (default 10G)",
    )
    p.add_argument(
        "--pointer-ttl", type=float, default=0.5, help="seconds LATEST may be reused (default 0.5)"
    )
    p.add_argument(
        "--list-ttl", type=float, default=1.0, help="seconds a listing may be reused (default 1)"
    )
    p.add_argument(
        "--corrupt-ttl",
        type=float,
        default=60.0,
        help="seconds an object found corrupt upstream is refused on a HEAD while its ETag "
        "is unchanged, instead of fetched again (default 60; 0: never)",
    )
    p.add_argument(
        "--workers", type=int, default=16, help="concurrent upstream object fetches (default 16)"
    )
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
    add_serving_args(p, bodies=False)
    add_log_args(p, default_level=None)
    p.set_defaults(func=cmd_relay)


def cmd_relay(args: argparse.Namespace) -> int:
    from . import preflight

    preflight.require_extra("web", "rollpatch relay")
    preflight.board_uri(args.board)
    preflight.port_free(args.host, args.port)
    from ..logs import configure

    configure(args.log_level, args.log_format)
    from ..relay import RelayConfig, RelayServer
    from .serving import serve_options, upstream_store
    from .trust import load_trust

    trust = load_trust(args, args.board, state=Path(args.cache) / "trust-state.json")
    config = RelayConfig(
        cache_dir=Path(args.cache),
        cache_bytes=args.cache_bytes,
        pointer_ttl=args.pointer_ttl,
        list_ttl=args.list_ttl,
        corrupt_ttl=args.corrupt_ttl,
        upstream_workers=args.workers,
    )
    server = RelayServer(
        upstream_store(args.board, args.board_token_file),
        config,
        options=serve_options(args),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        trust=trust,
    )
    url = server.start()
    print(
        f"rollpatch relay: serving {args.board} at {url} (cache {args.cache}, "
        f"{config.cache_bytes:,} bytes)",
        flush=True,
    )

    def stop(*_: object) -> None:
        server.request_stop()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.wait()
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
