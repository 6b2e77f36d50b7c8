"""The options of ``bench/peers.py`` and their checks: methods that exist, counts >= 1, and
every requested method's packages importable (:mod:`_peers_needs`) before anything runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from _peers_needs import missing
from _util import parse_size

__all__ = ["METHODS", "parse"]

METHODS = ("rollpatch", "xor", "shardcast")


def parse(
    description: str, argv: Sequence[str] | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """The options and the methods to run, in order; exits 2 with one line when a requested
    method's packages are missing (before minutes of preparing versions)."""
    p = argparse.ArgumentParser(description=description)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parse_size, default=parse_size("100M"))
    p.add_argument("--versions", type=int, default=10, help="versions after v0 (>= 1)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--mbps", type=float, default=1000.0, help="WAN cap, Mbit/s per direction")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="WAN round trip added")
    p.add_argument(
        "--poll-s",
        type=float,
        default=0.2,
        help="polling period of islands, relay pointer TTL and the middle node",
    )
    p.add_argument(
        "--island-commit",
        choices=("fused", "incremental", "full"),
        default="fused",
        help="rollpatch islands' commit: decoded straight into the live words in one pass "
        "inside the pause, as the XOR islands write theirs (default); staged while serving, "
        "targets in O(change), as the serving engines; or every touched tensor re-hashed "
        "inside the pause (ViewEngine)",
    )
    p.add_argument(
        "--origin-watch-s",
        type=float,
        default=0.05,
        help="how often the trainer region's relay reads LATEST on the directory board while "
        "long-polls wait (the relay's --watch, same default; 0.01 showed no gain under load)",
    )
    p.add_argument(
        "--push-bytes",
        type=int,
        default=64 << 20,
        help="the region relay's --push-bytes: a new version's manifest and step patch come "
        "in the origin's long-poll answer that announces it (docs/relay.md, 'Push'); 0: "
        "fetched one round trip after it (before this existed)",
    )
    p.add_argument(
        "--trainer-cast",
        choices=("torch", "numpy"),
        default="torch",
        help="torch: the trainer process imports torch and hands rollpatch's publisher torch "
        "CPU tensors, as a torch trainer does; numpy: numpy masters, no torch (the publisher "
        "casts with the native core either way, publisher/cast.py)",
    )
    p.add_argument(
        "--relay-log-level",
        default="warning",
        choices=("debug", "info", "warning"),
        help="the relays' --log-level (their logs: WORK/METHOD/logs/*-relay.log)",
    )
    p.add_argument("--settle-s", type=float, default=0.5)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--work", default=None, help="work directory (default: a temp dir)")
    p.add_argument("--json", help="write every measurement here")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or args.versions < 1 or args.islands < 1:
        p.error(f"--methods from {','.join(METHODS)}; --versions, --islands >= 1")
    gap = missing(methods, torch=args.trainer_cast == "torch")
    if gap is not None:
        print(gap, file=sys.stderr)
        raise SystemExit(2)
    return args, methods
