"""``rollpatch keygen | root`` and the ``--trust`` options every reading command shares."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, TrustError

if TYPE_CHECKING:
    from ..trust import Signer, Trust

__all__ = ["load_signer", "load_trust", "register", "signing_args", "trust_args"]

#: The shortest --every (a re-sign is a few store round trips).
MIN_EVERY_S = 1.0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "keygen",
        help="make an Ed25519 publisher key pair (PREFIX.key, PREFIX.pub)",
        description="Writes PREFIX.key (PEM, mode 0600; keep it secret, on the "
        "trainer) and PREFIX.pub (ed25519:<hex>; goes in the root). "
        "Never overwrites (docs/trust.md).",
    )
    p.add_argument(
        "-o", "--output", required=True, metavar="PREFIX", help="path prefix of the two files"
    )
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser(
        "root",
        help="make the next root of trust (keys, threshold), sign it and publish it to a board",
        description="Root 1 must be signed by THRESHOLD of its own keys; root "
        "n+1 also by THRESHOLD of root n's keys (rotation). Followers "
        "get a root file once (--trust) and follow rotations.",
    )
    p.add_argument("--board", help="board URI to publish the root to (its next version)")
    p.add_argument(
        "--key",
        action="append",
        required=True,
        metavar="PUB",
        help="a publisher public key file (.pub, or a .key); repeat for several",
    )
    p.add_argument(
        "--threshold",
        type=int,
        default=1,
        help="signatures needed on every manifest and LATEST (default 1)",
    )
    p.add_argument(
        "--sign",
        action="append",
        required=True,
        metavar="KEY",
        help="private key file to sign the root with; repeat for several",
    )
    p.add_argument(
        "--expires-days",
        type=float,
        default=365.0,
        help="the root expires after this many days (0: never; default 365)",
    )
    p.add_argument(
        "--version",
        type=int,
        dest="root_version",
        help="root version (default: the board's newest + 1, or 1)",
    )
    p.add_argument("-o", "--output", help="also write the signed root to this file")
    p.add_argument(
        "--force", action="store_true", help="replace an existing -o file (followers' anchor)"
    )
    p.set_defaults(func=cmd_root)

    p = sub.add_parser(
        "resign",
        help="re-sign a run's LATEST for the version it names (a publisher's heartbeat)",
        description="A signed LATEST expires (--latest-ttl, default 3600 s) unless its "
        "publisher re-signs it; the Publisher object does while it runs, `rollpatch "
        "publish` exits. Run this from a timer (or with --every) between CLI publishes, "
        "with the key the run is published with (docs/trust.md).",
    )
    p.add_argument("--board", required=True, help="store URI")
    p.add_argument("--run", required=True)
    signing_args(p)
    p.add_argument(
        "--every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="keep re-signing this often until interrupted (default: once)",
    )
    p.set_defaults(func=cmd_resign)


def trust_args(p: argparse.ArgumentParser, *, default_state: str) -> None:
    """``--trust ROOT`` and ``--trust-state PATH`` for a command that reads a board."""
    p.add_argument(
        "--trust",
        metavar="ROOT",
        help="trust root file (from `rollpatch root`): refuse what is unsigned, "
        "badly signed, expired or older than verified before",
    )
    p.add_argument(
        "--trust-state",
        metavar="PATH",
        help=f"rollback-protection state file (default: {default_state})",
    )


def signing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--signing-key",
        action="append",
        metavar="KEY",
        help="sign manifests and LATEST with this Ed25519 key (repeat for several)",
    )
    p.add_argument(
        "--latest-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a signed LATEST stays valid (default 3600)",
    )


def load_trust(args: argparse.Namespace, board: str, *, state: Path | None = None) -> Trust | None:
    """The :class:`Trust` of ``--trust`` (None without it); state file from
    ``--trust-state``, else ``state``, else the per-(root, board) default."""
    from ..trust import Trust

    if args.trust is None:
        if args.trust_state is not None:
            raise ConfigError("--trust-state needs --trust")
        return None
    path = Path(args.trust_state) if args.trust_state else state
    return Trust.from_file(args.trust, state_path=path, board=board)


def load_signer(args: argparse.Namespace) -> Signer | None:
    from ..trust import DEFAULT_LATEST_TTL_S, Signer

    if not args.signing_key:
        if args.latest_ttl is not None:
            raise ConfigError("--latest-ttl needs --signing-key")
        return None
    ttl = DEFAULT_LATEST_TTL_S if args.latest_ttl is None else args.latest_ttl
    return Signer.from_files(args.signing_key, latest_ttl_s=ttl)


def cmd_keygen(args: argparse.Namespace) -> int:
    from ..trust import write_keypair

    private, public, key = write_keypair(args.output)
    print(f"{private}: private key (keep it secret)\n{public}: public key\nkey id {key.keyid}")
    return 0


def cmd_root(args: argparse.Namespace) -> int:
    from ..board import Board
    from ..trust import Root, read_public_key, read_signing_key, sign_root, verify_initial_root
    from ..trust.root import verify_next_root

    if args.board is None and args.output is None:
        raise ConfigError("say where the root goes: --board URI and/or -o FILE")
    if args.board is not None:
        from .preflight import board_uri

        board_uri(args.board)
    if args.output is not None:  # before anything is put on the board
        from .preflight import output_file

        output_file(args.output, replace=args.force, inputs=[*args.key, *args.sign])
    keys = [read_public_key(p) for p in args.key]
    signers = [read_signing_key(p) for p in args.sign]
    if args.expires_days < 0:
        raise ConfigError("--expires-days must be >= 0")
    expires = (
        None if args.expires_days == 0 else float(int(time.time() + 86400 * args.expires_days))
    )
    board = None if args.board is None else Board(args.board)
    previous = None
    if args.root_version is not None:
        version = args.root_version
    elif board is not None:
        version = max(board.roots(), default=0) + 1
    else:
        version = 1
    if board is not None and version > 1:
        if board.root_raw(1) is not None:  # a root that does not chain is named, with the fix
            from ..publisher.signing import chained_trust

            chained_trust(board)
        raw_prev = board.root_raw(version - 1)
        if raw_prev is None:
            have = max(board.roots(), default=0)
            raise ConfigError(
                f"root {version} rotates from root {version - 1}, which the board does not "
                f"have (its newest: {have or 'none'})",
                hint=f"leave --version out (the next is {have + 1}); roots go one at a time",
            )
        previous = verify_initial_root(raw_prev)
    root = Root.new(keys, threshold=args.threshold, version=version, expires=expires)
    raw = sign_root(root, signers)
    if previous is not None:
        verify_next_root(previous, raw)  # the chain must hold before anything is published
    else:
        verify_initial_root(raw)
    if board is not None:
        board.put_root(raw)
    if args.output:
        from .codec import write_atomic

        write_atomic(Path(args.output), raw + b"\n")
    where = f" on {args.board}" if board is not None else ""
    out = f", written to {args.output}" if args.output else ""
    print(
        f"root {version}{where}: {len(keys)} key(s), threshold {args.threshold}, "
        f"signed by {len(signers)}{out}"
    )
    return 0


def _require_listed(board: Any, signer: Any) -> None:
    """Refuse keys the board's newest root (chained from its first) does not list in
    threshold: a LATEST they sign would replace the publisher's, and every follower with
    --trust would refuse it (found by an audit, session 39: a resign timer left with a key a
    rotation retired)."""
    from ..errors import RollpatchError
    from ..publisher.signing import chained_trust, keys_short

    try:
        trust = chained_trust(board)
    except RollpatchError:  # roots that do not chain: followers refuse them anyway
        return
    if trust is not None and keys_short(trust.root, signer):
        raise ConfigError(
            f"the board's root of trust (version {trust.root.version}) does not list these "
            "keys in threshold (retired by a rotation?): every follower with --trust would "
            "refuse a LATEST they sign; nothing re-signed",
            hint="re-sign with the keys the newest root lists (`rollpatch status --trust` "
            "names them); docs/trust.md, Rotating keys",
        )


def cmd_resign(args: argparse.Namespace) -> int:
    from ..board import Board
    from .preflight import board_uri

    board_uri(args.board, existing=True)
    signer = load_signer(args)
    if signer is None:
        raise ConfigError("resign needs --signing-key (the key the run is published with)")
    if args.every is not None and not args.every >= MIN_EVERY_S:
        raise ConfigError(f"--every must be at least {MIN_EVERY_S:g} s", value=args.every)
    if args.every is not None and args.every >= signer.latest_ttl_s:
        raise ConfigError(
            "--every must be shorter than --latest-ttl: LATEST would expire between re-signs",
            every=args.every,
            latest_ttl=signer.latest_ttl_s,
            hint="re-sign at a quarter of the TTL, as a publisher does",
        )
    board = Board(args.board, signer=signer)
    mine = Board(args.board, trust=signer.self_trust())  # what these keys signed
    while True:
        _require_listed(board, signer)  # each time: a rotation may retire the keys meanwhile
        current = Board(args.board).latest(args.run)  # as stored, whoever signed it
        if current is None:
            raise ConfigError(
                f"run {args.run!r} has no LATEST to re-sign", hint="publish a version first"
            )
        try:  # a LATEST is re-signed only for a version these keys published
            mine.manifest(args.run, current.version)
        except TrustError as e:
            raise TrustError(
                f"LATEST names {args.run}@{current.version}, whose manifest none of these keys "
                f"signed ({e.message}): nothing re-signed",
                reason=e.reason,
                run=args.run,
                version=current.version,
                hint="resign with the key the run is published with (a LATEST signed with "
                "another key would replace the publisher's, and followers would refuse it)",
            ) from None
        p = board.advance(args.run, current.version, refresh=True)
        until = time.strftime("%H:%M:%S", time.gmtime(time.time() + signer.latest_ttl_s))
        print(f"{args.run}@{p.version}: LATEST re-signed, valid until {until} UTC", flush=True)
        if args.every is None:
            return 0
        time.sleep(args.every)
