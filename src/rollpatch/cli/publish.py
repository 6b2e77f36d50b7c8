"""``rollpatch publish | status``: publish a checkpoint as a version; show what a board holds."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ConfigError, ManifestError, VersionNotFoundError
from .casting import quantised_note, served_dtypes
from .codec import policy_args, policy_from_args, whole_note
from .trust import load_signer, signing_args

__all__ = ["PUBLISH_SET_OTHERWISE", "register"]

#: PublisherConfig fields a one-shot publish sets another way.
PUBLISH_SET_OTHERWISE = {
    "policy": "--include, --exclude, --quantise-routers (QuantPolicy's flags)",
    "signer": "--signing-key",
    "skip_strides": "none: a fresh process has published no earlier version to skip from",
    "fold_every": "0: a fresh process holds no anchor's view to fold from",
    "max_pending": "1: publish is synchronous, nothing waits",
}


def register(sub: Any) -> None:
    from ..publisher.config import PublisherConfig
    from .flags import add_config_flags, count, version_number

    p = sub.add_parser(
        "publish",
        help="publish a master checkpoint as the run's next version",
        description="Publish one version from a checkpoint: resumes the run "
        "from the board, writes objects, manifest, then LATEST.",
    )
    p.add_argument(
        "ckpt",
        help="master checkpoint: .safetensors, a torch state dict file, or a "
        "Hugging Face model folder (its shards as its index names them)",
    )
    p.add_argument("--board", required=True, help="store URI (file:///dir, s3://bucket/prefix)")
    p.add_argument("--run", required=True, help="run name")
    add_config_flags(p, PublisherConfig, skip=PUBLISH_SET_OTHERWISE)
    policy_args(p)
    p.add_argument(
        "--version",
        type=version_number,
        dest="number",
        metavar="N",
        help="version number (default: LATEST + 1)",
    )
    p.add_argument("--step", type=count, help="trainer step recorded in the manifest")
    p.add_argument("--keyframe", action="store_true", help="also write a keyframe")
    signing_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("status", help="list a board's runs and versions")
    p.add_argument("--board", required=True, help="store URI")
    p.add_argument("--run", help="only this run")
    p.add_argument(
        "--limit",
        type=int,
        default=20,
        metavar="N",
        help="show the newest N versions per run (0: all)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    from .trust import trust_args

    trust_args(p, default_state="~/.local/state/rollpatch/trust-<root,board>.json")
    p.set_defaults(func=cmd_status)


def cmd_publish(args: argparse.Namespace) -> int:
    from ..io.checkpoint import load_masters
    from ..publisher import Publisher, PublisherConfig
    from .flags import config_kwargs
    from .preflight import board_uri, input_file

    board_uri(args.board)  # before the checkpoint loads (a publish may create the board)
    input_file(args.ckpt, "checkpoint", folder=True)

    policy = policy_from_args(args)
    config = PublisherConfig(
        **config_kwargs(args, PublisherConfig),
        policy=policy,
        skip_strides=(),
        fold_every=0,
        max_pending=1,
        signer=load_signer(args),
    )
    masters = load_masters(args.ckpt)
    served_dtypes(masters, args.ckpt)
    named = masters
    if config.names == "unwrap":  # the names the policy's patterns see
        from ..publisher.guards import engine_names

        named = engine_names(masters)[0]
    note = quantised_note(named, config.format, policy)
    with Publisher(args.board, args.run, config, asynchronous=False, sharded=False) as pub:
        if args.keyframe:
            pub.publish_keyframe()
        n = pub.publish(masters, args.number, step=args.step)
        s = pub.stats.versions[-1]
        created = bool(getattr(pub.board.store, "created", False))
    if created:  # a new board, or a typo or an absent mount: the user must be able to tell
        print(
            f"rollpatch: note: the board directory {pub.board.store.uri} did not exist: "
            f"created it (run {args.run!r} starts there at version {n})",
            file=sys.stderr,
        )
    if args.json:
        json.dump(
            {
                "run": args.run,
                "version": n,
                "board_created": created,
                "parent": s.parent,
                "keyframe": s.keyframe,
                "bytes": s.bytes,
                "patch_bytes": s.patch_bytes,
                "changed": s.changed,
                "tensors_dropped": s.tensors_dropped,
                "tensors_whole": s.tensors_whole,
                "timings": {k: getattr(s, k) for k in _TIMINGS},
            },
            sys.stdout,
            indent=1,
        )
        print()
        return 0
    parent = "none" if s.parent is None else str(s.parent)
    print(
        f"{args.run}@{n}: parent {parent}, {'keyframe, ' if s.keyframe else ''}"
        f"{s.bytes:,} bytes uploaded (step patch {s.patch_bytes:,} bytes, "
        f"{s.changed:,} elements changed{whole_note(s.tensors_dropped, s.tensors_whole)})" + note
    )
    # a phase the run did not have (no resume), or did inside another (the cast inside the
    # snapshot, the compare inside the fused encode) is left out rather than shown as 0.0 ms
    shown = [k for k in _TIMINGS if k == "total_s" or getattr(s, k) >= 5e-5]
    print("timings: " + ", ".join(f"{k[:-2]} {1000 * getattr(s, k):.1f} ms" for k in shown))
    return 0


_TIMINGS = (
    "resume_s",
    "snapshot_s",
    "cast_s",
    "diff_s",
    "encode_s",
    "upload_s",
    "commit_s",
    "total_s",
)


def cmd_status(args: argparse.Namespace) -> int:
    from ..board import Board

    if args.limit < 0:
        raise ConfigError("--limit must be >= 0")
    from .preflight import board_uri

    board_uri(args.board, existing=True)  # reading must not create a board directory
    from .trust import load_trust

    trust = load_trust(args, args.board)
    board = Board(args.board, trust=trust)
    runs = [args.run] if args.run else board.runs()
    report = [_run_status(board, run, args.limit) for run in runs]
    refused = sum(r["n_refused"] for r in report)
    pointers = sum(r["latest_refused"] is not None for r in report)
    manifests = refused - pointers
    code = 0 if refused == 0 else 2
    if refused:
        what = [f"{manifests} manifest{'s' * (manifests != 1)}"] if manifests else []
        what += [f"the LATEST of {pointers} run{'s' * (pointers != 1)}"] if pointers else []
        print(
            f"rollpatch: error: {' and '.join(what)} refused"
            + (" under the trust root" if trust is not None else "")
            + " (marked refused); followers plan around them or cannot reach them",
            file=sys.stderr,
        )
    if args.json:
        doc = {"board": args.board, "verified": trust is not None, "runs": report}
        json.dump(doc, sys.stdout, indent=1)
        print()
        return code
    if trust is not None:
        print(
            f"{args.board}: LATEST and manifests verified under the trust root {args.trust}"
            + (" (what did not verify is marked refused)" if refused else "")
        )
    if not report:
        print(f"{args.board}: no runs")
    for r in report:
        latest = "none" if r["latest"] is None else str(r["latest"])
        if r["latest_refused"] is not None:
            latest += f" (refused: {r['latest_refused']})"
        print(
            f"run {r['run']}: LATEST {latest}, {r['n_versions']} versions"
            + (f" ({r['n_retired']} signed by retired keys)" if r["n_retired"] else "")
            + f", {r['n_keyframes']} keyframes, {r['total_bytes']:,} bytes in objects"
        )
        if r["versions"]:
            print(
                f"  {'version':>8} {'parent':>8} {'patch bytes':>12} {'keyframe':>12} "
                f"{'skips from':>12}  target"
            )
        for v in r["versions"]:
            if "refused" in v:
                print(f"  {v['version']:>8} refused: {v['refused']}")
                continue
            if "retired" in v:
                print(
                    f"  {v['version']:>8} retired: signed only by keys of root {v['retired']}, "
                    "which a rotation retired (unreadable under the current root; gc can remove it"
                    + ("; as the relay checked it" if v["retired_checked_by"] == "relay" else "")
                    + ")"
                )
                continue
            kf = f"{v['keyframe_bytes']:,}" if v["keyframe"] else "-"
            parent = "-" if v["parent"] is None else v["parent"]
            skips = ",".join(str(b) for b in v["bases"] if b != v["parent"]) or "-"
            mark = "  <- LATEST" if v["version"] == r["latest"] else ""
            print(
                f"  {v['version']:>8} {parent:>8} {v['patch_bytes']:>12,} {kf:>12} "
                f"{skips:>12}  {v['target'][:16]}{mark}"
            )
        if r["n_versions"] > len(r["versions"]):
            print(f"  ... {r['n_versions'] - len(r['versions'])} older versions not shown")
        newest = r["versions"][-1]["version"] if r["versions"] else None
        if r["latest"] is not None and (newest is None or r["latest"] > newest):
            print(
                f"  warning: LATEST names version {r['latest']}, which has no manifest "
                "(moved past the manifests: followers cannot sync until it is restored or a "
                "signing publisher replaces it)",
                file=sys.stderr,
            )
    return code


def _run_status(board: Any, run: str, limit: int) -> dict[str, Any]:
    from ..board import Board
    from .retired import retired_root

    latest_refused = None
    try:
        pointer = board.latest(run)
    except ManifestError as e:  # expired, forged, unsigned: said, the run still listed
        latest_refused = f"{type(e).__name__}: {e}"
        try:  # which version it names, unverified (for the row it marks)
            pointer = Board(board.store).latest(run)
        except ManifestError:
            pointer = None
    versions = board.versions(run)
    if pointer is None and not versions and latest_refused is None:
        raise VersionNotFoundError("the board has no such run", run=run)
    rows, seen, total = [], set(), 0
    for n in versions:
        try:
            m = board.manifest(run, n)
        except ManifestError as e:  # unsigned, forged, malformed: shown, not fatal to the rest
            by = retired_root(board, run, n, e)
            if by is None:
                rows.append({"version": n, "refused": f"{type(e).__name__}: {e}"})
            else:
                rows.append({"version": n, "retired": by[0], "retired_checked_by": by[1]})
            continue
        for ref in m.objects():
            if ref.key not in seen:
                seen.add(ref.key)
                total += ref.size
        rows.append(
            {
                "version": n,
                "parent": m.parent,
                "format": m.format,
                "target": m.target,
                "created": m.created,
                "publisher": m.publisher,
                "shards": m.shards,
                "keyframe": m.is_keyframe,
                "keyframe_bytes": sum(k.ref.size for k in m.keyframes),
                "patch_bytes": sum(p.ref.size for p in m.patches),
                "bases": sorted({p.base for p in m.patches}),
                "signed": board.signed(run, n),
            }
        )
    shown = rows if limit == 0 else rows[-limit:]
    # LATEST must verify, and so must every version from it on
    latest = -1 if pointer is None or latest_refused is not None else pointer.version
    return {
        "run": run,
        "latest": None if pointer is None else pointer.version,
        "latest_target": None if pointer is None else pointer.target,
        "n_versions": len(rows),
        "n_keyframes": sum(bool(r.get("keyframe")) for r in rows),
        "n_refused": sum("refused" in r for r in rows)
        + sum("retired" in r for r in rows if r["version"] >= latest)
        + (latest_refused is not None),
        # below LATEST, signed only by keys a rotation retired (docs/trust.md): not a failure
        "n_retired": sum("retired" in r for r in rows if r["version"] < latest),
        "latest_refused": latest_refused,
        "total_bytes": total,
        "versions": shown,
    }
