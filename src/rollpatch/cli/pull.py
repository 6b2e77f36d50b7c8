"""``rollpatch pull``: reconstruct one version's view from a board, verified, to a file."""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from .trust import load_trust, trust_args

__all__ = ["PULL_UNUSED", "cmd_pull", "register"]

#: FollowerConfig fields a one-shot pull has no use for: it neither polls nor serves.
PULL_UNUSED = {
    "poll_s": "one sync, no polling",
    "audit_bytes_per_s": "nothing is served to audit",
    "audit_period_s": "nothing is served to audit",
    "boot": "a pull starts from nothing: there is no engine to adopt",
    "adopt_scan": "a pull starts from nothing: there is no engine to adopt",
    "fallback_older": "a pull writes the version asked for (LATEST by default) or nothing",
}


def register(sub: Any) -> None:
    from .flags import version_number

    p = sub.add_parser(
        "pull",
        help="reconstruct a version's view from a board (verified); "
        "OUT is written only if its digest matches the manifest",
    )
    p.add_argument(
        "--board",
        required=True,
        help="board store URI: a path, file://, s3://BUCKET/PREFIX, http(s):// relay",
    )
    p.add_argument("--run", required=True, help="run name")
    p.add_argument(
        "--version",
        type=version_number,
        default=None,
        dest="want",
        metavar="N",
        help="version to reconstruct (default: LATEST)",
    )
    p.add_argument("-o", "--output", required=True, help="output view (.safetensors)")
    from ..follower import FollowerConfig
    from .flags import add_config_flags

    add_config_flags(p, FollowerConfig, skip=PULL_UNUSED)
    trust_args(p, default_state="~/.local/state/rollpatch/trust-<root,board>.json")
    p.add_argument("-v", "--verbose", action="store_true", help="log retries and failures")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    from .preflight import board_uri, local_board, output_file

    board_uri(args.board, existing=True)
    board = local_board(args.board)
    trust_files = [p for p in (args.trust, args.trust_state) if p]  # never written over
    output_file(args.output, inputs=trust_files, inside=[str(board)] if board is not None else [])
    with _logging(args.verbose) as corrupt:
        return _pull(args, corrupt)


def _pull(args: argparse.Namespace, corrupt: list[str]) -> int:
    from ..engines import ViewEngine
    from ..errors import VerificationError
    from ..follower import Follower, FollowerConfig
    from ..io import save_view
    from .flags import config_kwargs

    trust = load_trust(args, args.board)
    config = FollowerConfig(**config_kwargs(args, FollowerConfig), fallback_older=False)
    engine = ViewEngine()
    follower = Follower(_board(args.board), args.run, engine, config, trust=trust)
    t0 = time.monotonic()
    version = follower.sync(args.want)
    plan = follower.last_plan
    if plan is not None:
        start = "nothing" if plan.have is None else plan.have
        again = (
            f" (re-planned around {len(corrupt)} corrupt object{'s' * (len(corrupt) != 1)}; "
            "what the plans before it fetched is counted below)"
            if corrupt
            else ""
        )
        print(
            f"plan {args.run}: {start} -> {plan.want}: {len(plan.steps)} steps, "
            f"{plan.n_objects} objects, {plan.bytes:,} bytes{again}"
        )
        for s in plan.steps:
            hop = f"keyframe {s.to}" if s.base is None else f"patch {s.base} -> {s.to}"
            print(f"  {hop:<24} {len(s.objects)} object(s) {s.bytes:>14,} bytes")
    view = engine.view
    view.invalidate()  # re-hash every tensor: the file must be exactly the manifest's target
    digest = view.digest()
    target = follower.board.manifest(args.run, version).target
    if digest != target:
        raise VerificationError(
            "reconstructed view does not match the manifest's target",
            run=args.run,
            version=version,
            expected=target[:16],
            actual=digest[:16],
        )
    t_verify = time.monotonic()
    save_view(view, args.output)
    st = follower.status()
    print(
        f"fetched {st.objects_fetched} objects ({st.bytes_fetched:,} bytes) in "
        f"{st.last_fetch_s or 0.0:.3f} s; staged in {st.last_stage_s or 0.0:.3f} s; "
        f"committed in {st.last_commit_s or 0.0:.3f} s; total {t_verify - t0:.3f} s"
    )
    print(
        f"{args.output}: {args.run}@{version}, {len(view)} tensors, {view.nbytes:,} bytes, "
        f"digest {digest[:16]} (verified)"
    )
    return 0


def _board(uri: str) -> Any:
    """The board at ``uri`` with a relay's or S3's own retries off (the follower's
    ``--retries`` are then all there are: ``--retries N`` is N + 1 attempts per read, not
    (N + 1) x the relay client's 4, as before: an audit, session 41)."""
    from ..board import Board
    from ..store import open_reader_store

    return Board(open_reader_store(uri))


@contextlib.contextmanager
def _logging(verbose: bool) -> Iterator[list[str]]:
    """The follower's log lines on stderr (``rollpatch.cli.console``): with ``-v`` all of
    them, INFO included; without, only a corrupt object it plans around (one WARNING line
    each: the pull then succeeds by another way, which the user should hear of, an audit,
    session 41), not its retries nor its failure (``main`` says that, in one line). Yields
    the keys of the corrupt objects planned around."""
    from . import console

    top, follower = logging.getLogger("rollpatch"), logging.getLogger("rollpatch.follower")
    level = top.level
    corrupt: list[str] = []

    def said(record: logging.LogRecord) -> bool:
        planned_around = record.module == "avoid" and record.levelno >= logging.WARNING
        if planned_around and "planning around it" in str(record.msg) and record.args:
            corrupt.append(str(record.args[1]))  # type: ignore[index]
        return verbose or planned_around

    follower.addFilter(said)
    if verbose:
        top.setLevel(logging.INFO)
        console.verbose()
    try:
        yield corrupt
    finally:
        follower.removeFilter(said)
        top.setLevel(level)
