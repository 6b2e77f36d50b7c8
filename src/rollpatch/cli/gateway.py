"""``rollpatch gateway``: one OpenAI-compatible front over several islands, routed by version."""

from __future__ import annotations

import argparse
from typing import Any

from ..logs import add_log_args

__all__ = ["GATEWAY_SET_OTHERWISE", "register"]

#: GatewayConfig fields set by other flags.
GATEWAY_SET_OTHERWISE = {
    "body": "--max-body-bytes, --body-timeout",
    "island_token": "--island-token-file",
}


def register(sub: Any) -> None:
    from ..gateway.config import GatewayConfig
    from .flags import add_config_flags
    from .serving import add_serving_args

    p = sub.add_parser(
        "gateway",
        help="route OpenAI requests over islands (sidecars) by the "
        "version each serves (docs/gateway.md)",
        description="Polls each island's sidecar, routes every request to an "
        "island that satisfies its version constraint, retries "
        "refusals and failures elsewhere (docs/gateway.md).",
    )
    p.add_argument(
        "--sidecar",
        action="append",
        required=True,
        metavar="[NAME=]URL",
        help="an island's sidecar base URL; repeat for each island (the name "
        "defaults to host:port)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 to serve other machines)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    add_config_flags(p, GatewayConfig, skip=GATEWAY_SET_OTHERWISE)
    p.add_argument(
        "--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug")
    )
    p.add_argument(
        "--island-token-file",
        metavar="FILE",
        help="bearer token the islands' sidecars require on inference routes",
    )
    add_serving_args(p, drain=True)
    add_log_args(p, default_level=None)
    p.set_defaults(func=cmd_gateway)


def cmd_gateway(args: argparse.Namespace) -> int:
    from . import preflight

    preflight.require_extra("web", "rollpatch gateway")
    preflight.port_free(args.host, args.port)
    from ..logs import configure

    configure(args.log_level, args.log_format, service="gateway")
    from ..gateway import GatewayConfig, parse_island
    from ..gateway.server import start_gateway
    from .flags import config_kwargs
    from .secrets import read_token
    from .serving import ShutdownSignals, body_limits, serve_options

    islands = [parse_island(s) for s in args.sidecar]
    island_token = (
        read_token(args.island_token_file, "--island-token-file file")
        if args.island_token_file
        else None
    )
    config = GatewayConfig(
        **config_kwargs(args, GatewayConfig), island_token=island_token, body=body_limits(args)
    )
    with ShutdownSignals() as signals:  # caught while it starts, too
        running = start_gateway(
            islands,
            host=args.host,
            port=args.port,
            config=config,
            log_level=args.log_level,
            options=serve_options(args),
        )
        names = ", ".join(f"{i.name}={i.url}" for i in islands)
        print(f"rollpatch gateway: {running.url} -> {len(islands)} island(s): {names}", flush=True)
        try:
            gw = running.gateway
            signals.serve("gateway", gw.inflight, gw.drain, args.shutdown_grace)
        finally:
            running.stop()
    return 0
