"""``rollpatch sidecar``: the version-aware HTTP front of one engine."""

from __future__ import annotations

import argparse
from typing import Any

from ..logs import add_log_args
from .trust import load_trust, trust_args

__all__ = [
    "FOLLOWER_FLAGS",
    "FOLLOWER_SET_OTHERWISE",
    "FOLLOWER_UNSET",
    "SIDECAR_SET_OTHERWISE",
    "register",
]

#: SidecarConfig fields set by other flags: the token from a file, the serving flags, the
#: follower's own flags.
SIDECAR_SET_OTHERWISE = {
    "admin_token": "--admin-token-file",
    "body": "--max-body-bytes, --body-timeout",
    "follower": "the follower's flags",
}
FOLLOWER_SET_OTHERWISE: dict[str, str] = {}
#: The follower's flags whose declared names (``pull``'s) are vague beside a server's own
#: timeouts and workers: here they say what they fetch. The old names still work, with a
#: one-line deprecation warning.
FOLLOWER_FLAGS = {
    "fetch_workers": "--fetch-workers",
    "retries": "--fetch-retries",
    "backoff_s": "--fetch-backoff",
    "timeout_s": "--fetch-timeout",
}
#: The follower's flags that default to none (the config's default applies): given without
#: ``--boot adopt``, ``--adopt-scan`` is refused instead of ignored.
FOLLOWER_UNSET = ("adopt_scan",)


def register(sub: Any) -> None:
    from ..follower import FollowerConfig
    from ..sidecar import SidecarConfig
    from ..sidecar.server import ENGINES
    from .flags import add_config_flags
    from .serving import add_serving_args

    p = sub.add_parser(
        "sidecar",
        help="serve an engine's OpenAI API under version constraints",
        description="Follows RUN on the board, keeps the engine on a verified "
        "version, and proxies OpenAI routes (docs/sidecar.md).",
    )
    p.add_argument("--board", required=True, help="store URI (file://, s3://, http:// relay)")
    p.add_argument("--run", required=True)
    p.add_argument("--engine", choices=ENGINES, default="reference")
    p.add_argument("--model", help="model directory (reference engine)")
    p.add_argument(
        "--engine-url",
        help="the engine server's URL, http://HOST:PORT (vllm, sglang; a trailing /v1 is dropped)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--admin-token-file", help="require this bearer token on admin routes")
    p.add_argument("--threads", type=int, help="torch threads for the reference engine")
    p.add_argument(
        "--writes",
        choices=("in_place", "double_buffer"),
        default="in_place",
        help="how a commit reaches the weights (reference, vllm, sglang): in_place (the pause "
        "scatters the changed words) or double_buffer (new storage built while serving, exchanged in "
        "the pause: shortest pause, + the touched parameters in memory); docs/engines.md",
    )
    p.add_argument(
        "--kv-on-commit",
        choices=("recompute", "keep"),
        default="recompute",
        help="vllm: what a commit does to the KV cache of requests in flight: recompute it with "
        "the new weights (their later tokens are the new version's for the whole prefix) or keep "
        "it (no recompute; later tokens from the new weights over the old KV, as the reference "
        "engine does; labels span both versions either way); docs/vllm.md",
    )
    p.add_argument(
        "--staging",
        choices=("thread", "inline"),
        default="thread",
        help="vllm: where the workers stage a version: in a thread while vLLM serves, or inline "
        "on its engine loop (generation held for the staging, which gets every core: on a host "
        "whose cores the forward passes keep busy, the shorter total cost); docs/vllm.md",
    )
    # the flags of the sidecar's and its follower's configs (defaults: the configs' own)
    add_config_flags(p, SidecarConfig, skip=SIDECAR_SET_OTHERWISE)
    add_config_flags(
        p.add_argument_group("follower (polling, fetching, audit)"),
        FollowerConfig,
        skip=FOLLOWER_SET_OTHERWISE,
        rename=FOLLOWER_FLAGS,
        unset=FOLLOWER_UNSET,
    )
    p.add_argument(
        "--engine-token-file",
        metavar="FILE",
        help="vllm, sglang: the bearer token the engine server was started with (its "
        "--api-key): sent on the sidecar's calls and on the requests it proxies",
    )
    p.add_argument(
        "--board-token-file",
        metavar="FILE",
        help="bearer token to send to a relay board that requires one",
    )
    add_serving_args(p, drain=True)
    add_log_args(p)
    trust_args(p, default_state="~/.local/state/rollpatch/trust-<root,board>.json")
    p.set_defaults(func=cmd_sidecar)


def cmd_sidecar(args: argparse.Namespace) -> int:
    from . import preflight

    # cheap mistakes first: nothing heavy (torch, a model, the web stack) is loaded yet
    preflight.require_extra(
        "reference" if args.engine == "reference" else "web",
        f"rollpatch sidecar --engine {args.engine}",
    )
    preflight.board_uri(args.board, existing=True)
    if args.adopt_scan is not None and args.boot != "adopt":
        from ..errors import ConfigError

        raise ConfigError(
            "--adopt-scan only applies with --boot adopt",
            hint="add --boot adopt, or leave --adopt-scan out",
        )
    preflight.port_free(args.host, args.port)
    if args.engine == "reference":
        preflight.model_dir(args.model)
    preflight.offline()
    from ..logs import configure

    configure(args.log_level, args.log_format, service="sidecar")
    from ..board import Board
    from ..follower import FollowerConfig
    from ..sidecar import SidecarConfig
    from ..sidecar.server import make_engine, start_sidecar
    from .flags import config_kwargs
    from .secrets import read_token
    from .serving import ShutdownSignals, body_limits, serve_options, upstream_store

    token = (
        read_token(args.admin_token_file, "--admin-token-file file")
        if args.admin_token_file
        else None
    )
    trust = load_trust(args, args.board)
    board = Board(
        upstream_store(args.board, args.board_token_file, retried_by="reader"), trust=trust
    )
    config = SidecarConfig(
        **config_kwargs(args, SidecarConfig),
        admin_token=token,
        body=body_limits(args),
        follower=FollowerConfig(**config_kwargs(args, FollowerConfig)),
    )
    options = serve_options(args)
    engine_token = (
        read_token(args.engine_token_file, "--engine-token-file file")
        if args.engine_token_file
        else None
    )
    engine, url = make_engine(
        args.engine,
        model=args.model,
        engine_url=args.engine_url,
        threads=args.threads,
        writes=args.writes,
        kv_on_commit=args.kv_on_commit,
        staging=args.staging,
        engine_token=engine_token,
    )
    _check_engine_token(url, engine_token)
    with ShutdownSignals() as signals:  # caught while it starts, too
        running = start_sidecar(
            board,
            args.run,
            engine,
            url,
            host=args.host,
            port=args.port,
            config=config,
            log_level="warning",
            options=options,
        )
        print(
            f"rollpatch sidecar: {running.url} -> {args.engine} engine at {url}; following "
            f"{args.run} on {args.board} ({args.commit_mode} commits)",
            flush=True,
        )
        sc = running.sidecar
        try:
            signals.serve("sidecar", lambda: sc.gate.inflight, sc.drain, args.shutdown_grace)
        finally:  # bounded: a hung engine's calls must not keep the sidecar alive
            signals.finish("sidecar", running.stop, max(args.shutdown_grace, 5.0))
    return 0


def _check_engine_token(url: str, token: str | None) -> None:
    """Refuse to start when the engine refuses the sidecar's token (or its absence) on its
    OpenAI routes; an engine not answering yet is waited for as before."""
    import httpx

    from ..errors import ConfigError
    from ..sidecar.app import engine_refusal

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        status = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0).status_code
    except httpx.HTTPError:
        return
    why = engine_refusal(status)
    if why is not None:
        raise ConfigError(why, engine_url=url, hint="pass --engine-token-file FILE holding the key")
