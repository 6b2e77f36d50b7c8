"""The ``rollpatch`` command line. Each concept registers its subcommands from its own module."""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import RollpatchError

__all__ = ["build_parser", "main"]

#: Exit status when input is refused (verification failure, corrupt or mismatched data).
EXIT_REFUSED = 2
#: Exit status when stdout's reader went away (128 + SIGPIPE, what a shell reports for tools
#: that SIGPIPE killed).
EXIT_SIGPIPE = 141


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``rollpatch CMD: error: ...``), exit 2, like every refusal."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_REFUSED, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """``--version``, said only when asked (it loads the codec core to name it)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> NoReturn:
        print(_version())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    from ..netem import cli as netem
    from . import analyze, codec, demo, gateway, gc, publish, pull, relay, sidecar, trust

    parser = _Parser(
        prog="rollpatch",
        description="Lossless patches over engine-visible weights for RL rollout fleets.",
    )
    parser.add_argument(
        "--version",
        action=_Version,
        nargs=0,
        help="show the version, the codec core in use (native and its instruction set, or "
        "the numpy reference) and the Python, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (codec, analyze, publish, pull, gc, sidecar, gateway, relay, netem, demo, trust):
        module.register(sub)
    return parser


def _parser_of(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The subcommand's parser (``parser`` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _version() -> str:
    import platform

    from .. import __version__

    return f"rollpatch {__version__} ({_native()}; Python {platform.python_version()})"


def _native() -> str:
    """The codec core in use (``native.describe``), or why none is."""
    try:
        from ..native import describe
    except ImportError as e:  # numpy itself missing: nothing runs anyway
        return f"codec unavailable: {e}"
    return describe()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: runs a subcommand; a RollpatchError prints one clear line, exit 2.

    When the reader of stdout goes away (``rollpatch ... --json | head``), the command stops
    quietly with status 141 (128 + SIGPIPE), as Unix tools killed by SIGPIPE do.
    """
    try:
        return _run(argv)
    except BrokenPipeError:
        return _stdout_gone()
    except SystemExit:  # --help, usage errors: their text may be waiting in stdout's buffer
        if not _flush_stdout():
            raise SystemExit(EXIT_SIGPIPE) from None
        raise


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand they were given to, pointing to its --help
        _parser_of(parser, getattr(args, "command", None)).error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    previous = _terminate_by_exception()
    try:
        code = _call(args)
        sys.stdout.flush()  # a closed pipe must surface here, not at interpreter exit
        return code
    except _Terminated:  # what was half-written (a pull's temp file) is removed on the way
        print("rollpatch: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError as e:
        if _stdout_broken():
            raise
        print(f"rollpatch: error: {e}", file=sys.stderr)  # a socket, not our reader
        return EXIT_REFUSED
    except RollpatchError as e:
        print(f"rollpatch: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as e:  # missing or unreadable files: one clear line, not a traceback
        said = f"{e.strerror} [path={e.filename}]" if e.strerror and e.filename else e
        print(f"rollpatch: error: {said}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _call(args: argparse.Namespace) -> int:
    """Run the subcommand; a one-shot command's log records reach stderr with their fields
    (``console``); a service (``--log-format``) configures its own structured logs."""
    if hasattr(args, "log_format"):
        return int(args.func(args) or 0)
    from .console import console_logging

    with console_logging():
        return int(args.func(args) or 0)


class _Terminated(BaseException):
    """SIGTERM, raised where the command is (services install their own handling)."""


def _terminate_by_exception() -> signal.Handlers | Any | None:
    """Make SIGTERM (what ``timeout``, systemd and Kubernetes send) unwind the command like
    Ctrl-C does, so its ``finally`` blocks run: a pull killed by it left its multi-hundred-MB
    temp file behind (found by an audit, session 39). Returns the handler before (None: not
    the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated

    return signal.signal(signal.SIGTERM, terminated)


def _stdout_broken() -> bool:
    """Whether stdout is a pipe whose reader has gone away (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor, or no poll on this OS
        return False


def _flush_stdout() -> bool:
    """Flush stdout; False (and stdout silenced) when its reader has gone away."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_gone()
        return False
    return True


def _stdout_gone() -> int:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (captured in tests): nothing to do
        pass
    return EXIT_SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
