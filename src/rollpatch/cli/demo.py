"""``rollpatch demo``: an end-to-end run of the codec on simulated AdamW steps.

A trainer-side loop (the simulator) takes RL-sized AdamW steps; each step is cast to the served
formats, diffed against the previous version, encoded, decoded on a "replica" that holds only
its own view, applied in place and verified bit for bit against a fresh cast. A lagging
replica catches up with one composed patch. Patches and the keyframe go to ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import zstandard

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="end-to-end codec run on simulated AdamW steps")
    p.add_argument("--params", type=float, default=20e6, help="model size (parameters)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--formats", default="bf16,fp8-e4m3-block128,nvfp4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/demo", help="directory for keyframes and patches")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..errors import ConfigError, TargetMismatchError
    from ..formats import cast_view
    from ..io import save_view
    from ..patch import apply, compose, decode, diff, encode
    from ..sim import AdamSim, SimConfig

    if args.steps < 1:
        raise ConfigError("--steps must be at least 1")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sim = AdamSim(SimConfig(n_params=int(args.params), lr=args.lr, seed=args.seed))
    print(f"rollpatch demo: {sim.n_params / 1e6:.1f}M-parameter Llama-like model, AdamW "
          f"lr={args.lr:g}, {args.steps} steps, formats {', '.join(formats)}")
    views = {f: [cast_view(sim.masters(), f)] for f in formats}
    replicas = {f: views[f][0].copy() for f in formats}
    for f in formats:
        save_view(views[f][0], out / f"{f}.v0.safetensors")
    head = ("step", "format", "changed %", "patch bytes", "% of view", "vs xor+zstd3",
            "encode ms", "apply ms")
    print("  ".join(f"{h:>12}" for h in head))
    zc = zstandard.ZstdCompressor(level=3)
    total = 0
    for step in range(1, args.steps + 1):
        sim.step()
        for f in formats:
            prev = views[f][-1]
            cur = cast_view(sim.masters(), f, previous=prev)
            views[f].append(cur)
            patch = diff(prev, cur)
            t0 = time.perf_counter()
            blob = encode(patch, prev)
            t1 = time.perf_counter()
            replica = replicas[f]
            apply(replica, decode(blob, replica))
            t2 = time.perf_counter()
            if replica.digest() != cur.digest():
                raise TargetMismatchError("replica diverged from the trainer", format=f)
            (out / f"{f}.v{step - 1}-v{step}.rpatch").write_bytes(blob)
            xz = sum(len(zc.compress((prev[n].data ^ cur[n].data).tobytes()))
                     for n in cur if n in prev and prev[n].shape == cur[n].shape)
            n_el = sum(t.n_elements for t in cur.values())
            row = (step, f, f"{100 * patch.n_changed / n_el:.3f}", f"{len(blob):,}",
                   f"{100 * len(blob) / cur.nbytes:.3f}", f"{len(blob) / max(xz, 1):.3f}x",
                   f"{1e3 * (t1 - t0):.0f}", f"{1e3 * (t2 - t1):.0f}")
            print("  ".join(f"{c!s:>12}" for c in row))
            total += 1
    for f in formats:  # a replica that slept through every step catches up with one patch
        chain = [diff(a, b) for a, b in zip(views[f], views[f][1:])]
        folded = chain[0]
        for p in chain[1:]:
            folded = compose(folded, p)
        if not folded.equals(diff(views[f][0], views[f][-1])):
            raise TargetMismatchError("composed patch differs from the direct diff", format=f)
        lagging = apply(views[f][0], folded, inplace=False)
        blob = encode(folded, views[f][0])
        print(f"{f}: replica {args.steps} versions behind catches up with one composed patch "
              f"of {len(blob):,} bytes ({100 * len(blob) / lagging.nbytes:.3f}% of the view), "
              "bit-exact")
    print(f"all {total} transitions verified bit-exact; patches and keyframes in {out}/")
    return 0
