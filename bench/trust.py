"""Trust benchmark: what signing and verifying cost per version, against an unsigned board.

Run: ``python bench/trust.py`` (about 20 s), or ``--versions 200 --objects 64 --json out.json``.

Board metadata only (objects are tiny: the cost of fetching and checking object bytes is the
same signed or not). Two boards in ``memory://`` stores, filled the same way: an unsigned one and
one signed with one Ed25519 key (threshold 1). Per version, timed with ``perf_counter``, the
median over ``--versions`` and ``--repeats``:

- **publish**: ``Board.put_manifest`` + ``Board.advance`` (signed: the manifest envelope, the
  LATEST envelope; ``advance`` also checks the current LATEST is the publisher's own);
- **poll**: ``Board.latest`` on a reader (signed: envelope verify, expiry, rollback check);
- **manifest**: ``Board.manifest`` on a fresh reader (no cache; signed: envelope verify);
- **manifest, N objects**: the same for a manifest of ``--objects`` patch objects (a sharded
  version), to show how verification scales with manifest size.

Baseline: the same operation on the unsigned board, measured in the same run; the table gives
the ratio signed / unsigned and the absolute added time per operation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

from rollpatch.board import Board
from rollpatch.manifest import KeyframeObject, Manifest, PatchObject
from rollpatch.store import MemoryStore
from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root

RUN = "bench"
D = "d" * 64


def _manifest(board: Board, n: int, objects: int) -> Manifest:
    if n == 0:
        ref = board.put_object(RUN, b"keyframe", "safetensors")
        return Manifest(
            run=RUN,
            version=0,
            parent=None,
            format="bf16",
            target=D,
            view_bytes=8,
            created=time.time(),
            publisher="bench",
            keyframes=(KeyframeObject(ref),),
        )
    pats = tuple(
        PatchObject(board.put_object(RUN, f"{n}:{s}".encode(), "rpatch"), n - 1, D, s)
        for s in range(objects)
    )
    return Manifest(
        run=RUN,
        version=n,
        parent=n - 1,
        format="bf16",
        target=D,
        view_bytes=8,
        created=time.time(),
        publisher="bench",
        patches=pats,
        shards=objects,
    )


def measure(versions: int, objects: int, signed: bool) -> dict[str, float]:
    key = SigningKey.generate()
    root = sign_root(Root.new([key.public]), [key])
    store = MemoryStore(f"bench-trust-{uuid.uuid4().hex}")
    writer = Board(store, signer=Signer(keys=(key,)) if signed else None)
    if signed:
        writer.put_root(root)
    trust = Trust(root) if signed else None
    t: dict[str, list[float]] = {"publish": [], "poll": [], "manifest": [], "manifest_n": []}
    clock = time.perf_counter
    for n in range(versions):
        m = _manifest(writer, n, 1)
        t0 = clock()
        writer.put_manifest(m)
        writer.advance(RUN, n)
        t1 = clock()
        reader = Board(store, trust=trust)
        t2 = clock()
        reader.latest(RUN)
        t3 = clock()
        reader.manifest(RUN, n)
        t4 = clock()
        t["publish"].append(t1 - t0)
        t["poll"].append(t3 - t2)
        t["manifest"].append(t4 - t3)
    writer.put_manifest(_manifest(writer, versions, objects))
    for _ in range(max(5, versions // 10)):
        reader = Board(store, trust=trust)
        t0 = clock()
        reader.manifest(RUN, versions)
        t["manifest_n"].append(clock() - t0)
    return {k: statistics.median(v) for k, v in t.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=300)
    p.add_argument("--objects", type=int, default=256, help="objects in the large manifest")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    runs = {"unsigned": [], "signed": []}  # type: dict[str, list[dict[str, float]]]
    for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
        for mode in ("unsigned", "signed"):
            runs[mode].append(measure(args.versions, args.objects, mode == "signed"))
    med = {
        mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()
    }
    rows = [
        ("publish (put_manifest + advance)", "publish"),
        ("poll (Board.latest)", "poll"),
        ("manifest read, 1 object", "manifest"),
        (f"manifest read, {args.objects} objects", "manifest_n"),
    ]
    print(
        f"trust bench: {args.versions} versions x {args.repeats} repeats, memory:// store, "
        f"Ed25519 threshold 1; medians"
    )
    print(
        f"{'operation':<36} {'unsigned':>11} {'signed':>11} {'signed/unsigned':>16} {'added':>10}"
    )
    for label, k in rows:
        u, s = med["unsigned"][k], med["signed"][k]
        print(
            f"{label:<36} {u * 1e6:>9.0f}us {s * 1e6:>9.0f}us {s / u:>15.2f}x "
            f"{(s - u) * 1e6:>8.0f}us"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "median_s": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
