"""``rollpatch pull``: reconstruct one version's view from a board, verified, to a file."""

from __future__ import annotations

import argparse
import logging
import time
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
    from .preflight import board_uri, output_file

    board_uri(args.board, existing=True)
    output_file(args.output)
    logger = logging.getLogger("rollpatch.follower")
    propagate = logger.propagate
    _logging(args.verbose)
    try:
        return _pull(args)
    finally:
        logger.propagate = propagate  # a process that calls main() twice (tests) gets it back


def _pull(args: argparse.Namespace) -> int:
    from ..engines import ViewEngine
    from ..errors import VerificationError
    from ..follower import Follower, FollowerConfig
    from ..io import save_view
    from .flags import config_kwargs

    trust = load_trust(args, args.board)
    config = FollowerConfig(**config_kwargs(args, FollowerConfig), fallback_older=False)
    engine = ViewEngine()
    follower = Follower(args.board, args.run, engine, config, trust=trust)
    t0 = time.monotonic()
    version = follower.sync(args.want)
    plan = follower.last_plan
    if plan is not None:
        start = "nothing" if plan.have is None else plan.have
        print(
            f"plan {args.run}: {start} -> {plan.want}: {len(plan.steps)} steps, "
            f"{plan.n_objects} objects, {plan.bytes:,} bytes"
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


def _logging(verbose: bool) -> None:
    logger = logging.getLogger("rollpatch.follower")
    if verbose:
        logging.basicConfig(level=logging.INFO, format="rollpatch: %(levelname)s %(message)s")
    else:  # errors surface as one line from main(), whatever else configured logging
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())
        logger.propagate = False
