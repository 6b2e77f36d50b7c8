"""``python -m rollpatch.netem``: run one link emulator until interrupted.

:func:`register` adds the same options as a ``netem`` subcommand to an argparse subparsers
object (the ``rollpatch`` command line).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..config import add_config_flags, config_kwargs
from ..errors import RollpatchError
from .config import LinkConfig, parse_hostport
from .link import Link

__all__ = ["add_arguments", "config_from_args", "main", "register", "run"]

_DESCRIPTION = """\
A userspace TCP link emulator: listens on --listen, forwards every connection to --upstream,
and adds one-way latency, a bandwidth cap shared by all connections (per direction) and
optional loss (as retransmission delay) to both directions (docs/netem.md)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The emulator's options: one per :class:`LinkConfig` field, made from its declaration."""
    add_config_flags(p, LinkConfig)


def config_from_args(args: argparse.Namespace) -> LinkConfig:
    """A :class:`LinkConfig` from parsed options (:class:`ConfigError` on bad values)."""
    kwargs = config_kwargs(args, LinkConfig)
    for name in ("upstream", "listen"):  # HOST:PORT as given: refused here, in one line
        if isinstance(kwargs[name], str):
            kwargs[name] = parse_hostport(kwargs[name], option=f"--{name}")
    return LinkConfig(**kwargs)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; prints the listening address first (one line)."""
    cfg = config_from_args(args)
    stop = threading.Event()
    old = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with Link(cfg) as link:
            host, port = link.address
            print(
                f"rollpatch netem: listening on {host}:{port} -> "
                f"{cfg.upstream[0]}:{cfg.upstream[1]} (latency {cfg.latency_ms:g} ms one-way, "
                f"{'unlimited' if cfg.mbps is None else f'{cfg.mbps:g} Mbit/s'}, "
                f"loss {cfg.loss:g})",
                flush=True,
            )
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            s = link.stats()
        print(
            f"rollpatch netem: stopped after {s.connections} connection(s), "
            f"{s.bytes_up:,} bytes up, {s.bytes_down:,} bytes down",
            flush=True,
        )
    finally:
        signal.signal(signal.SIGTERM, old)
    return 0


def register(sub: Any) -> None:
    """Add ``netem`` to a subparsers object (``sub.add_parser``)."""
    p = sub.add_parser(
        "netem",
        help="emulate a WAN link on loopback (latency, bandwidth, loss)",
        description=_DESCRIPTION,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m rollpatch.netem``; a bad option prints one line, exit 2."""
    parser = argparse.ArgumentParser(prog="python -m rollpatch.netem", description=_DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except RollpatchError as e:
        print(f"rollpatch netem: error: {e}", file=sys.stderr)
        return 2
