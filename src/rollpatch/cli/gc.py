"""``rollpatch gc``: retention — delete what no retained version needs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    from .flags import count, version_number

    p = sub.add_parser(
        "gc",
        help="delete old versions and orphaned objects (plans stay valid)",
        description="Keeps LATEST, the last N versions, pinned versions and the "
        "keyframe they need; see docs/board.md.",
    )
    p.add_argument("--board", required=True, help="store URI")
    p.add_argument("--run", required=True)
    p.add_argument(
        "--keep-last",
        type=count,
        default=32,
        metavar="N",
        help="keep LATEST and the N versions before it (default 32)",
    )
    p.add_argument(
        "--pin",
        type=version_number,
        action="append",
        default=[],
        metavar="V",
        help="keep version V and everything after it (repeatable)",
    )
    p.add_argument(
        "--orphan-grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="only delete unreferenced objects older than this (default 3600)",
    )
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)


#: Below this, an --orphan-grace may take a running publisher's objects (it warns).
_SHORT_GRACE_S = 60.0


def cmd_gc(args: argparse.Namespace) -> int:
    from ..board import Board
    from ..errors import ConfigError
    from ..retention import collect
    from .preflight import board_uri

    board_uri(args.board, existing=True)
    board = Board(args.board)
    versions = board.versions(args.run)
    if not versions and board.latest(args.run) is None:  # a typo'd run is not a success
        runs = board.runs()
        raise ConfigError(
            f"run {args.run!r} has nothing on the board",
            hint=f"runs on it: {', '.join(runs[:10])}" if runs else "the board has no runs",
        )
    if args.orphan_grace < _SHORT_GRACE_S and not args.dry_run:  # an audit, session 40
        print(
            f"{args.run}: warning: --orphan-grace {args.orphan_grace:g} s: an object a running "
            "publisher has uploaded but not yet named in a manifest counts as an orphan, and "
            "that publisher then stops ('manifest names an object that is not durable')",
            file=sys.stderr,
        )
    for v in sorted(set(args.pin) - set(versions)):
        print(f"{args.run}: --pin {v}: no such version; it pins nothing", file=sys.stderr)
    report = collect(
        board,
        args.run,
        keep_last=args.keep_last,
        pinned=args.pin,
        orphan_grace_s=args.orphan_grace,
        dry_run=args.dry_run,
    )
    if args.json:
        json.dump(asdict(report), sys.stdout, indent=1)
        print()
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    why = ""
    if report.keyframe_floor is not None:
        why = f" (v{report.keyframe_floor}: the keyframe the kept versions are rebuilt from)"
    print(
        f"{args.run}: keeping versions >= {report.cutoff}{why}; {verb} "
        f"{len(report.versions_deleted)} versions, {len(report.objects_deleted)} objects, "
        f"{len(report.orphans_deleted)} orphans ({report.bytes_freed:,} bytes)"
    )
    for v, why in report.unreadable:
        print(
            f"{args.run}@{v}: manifest unreadable ({why}); its objects are left to the "
            f"orphan rule (--orphan-grace)",
            file=sys.stderr,
        )
    return 0
