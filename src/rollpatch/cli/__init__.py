"""The ``rollpatch`` command line. Each concept registers its subcommands from its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import RollpatchError

__all__ = ["build_parser", "main"]

#: Exit status when input is refused (verification failure, corrupt or mismatched data).
EXIT_REFUSED = 2


def build_parser() -> argparse.ArgumentParser:
    from . import analyze, codec, demo, gateway, gc, publish, pull, relay, sidecar

    parser = argparse.ArgumentParser(
        prog="rollpatch",
        description="Lossless patches over engine-visible weights for RL rollout fleets.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (codec, analyze, publish, pull, gc, sidecar, gateway, relay, demo):
        module.register(sub)
    return parser


def _version() -> str:
    from .. import __version__

    return f"rollpatch {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: runs a subcommand; a RollpatchError prints one clear line, exit 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RollpatchError as e:
        print(f"rollpatch: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as e:  # missing or unreadable files: one clear line, not a traceback
        print(f"rollpatch: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
