"""``rollpatch demo``: cross-region asynchronous RL on one machine (docs/demo.md).

By default: a trainer runs GRPO on a tiny model made locally and publishes a version after
every step; three rollout islands (one reading the board directly, two through relays behind
an *emulated* WAN) serve its rollouts through a gateway under a staleness bound; the run is
shown live, checked (labels vs weights, LATEST, catch-up, verified bytes) and reported.

``--codec-only``: the older codec walk-through. Simulated AdamW steps are cast to the served
formats, diffed, encoded, decoded on a replica and verified bit for bit; a replica that slept
through every step catches up with one composed patch (no processes).

Every flag is made from a field of :class:`~rollpatch.demo.DemoConfig` or of the walk-through's
:class:`CodecWalk` (:mod:`rollpatch.cli.flags`), so each default is written once, in its config.
``--steps``, ``--lr``, ``--out`` and ``--seed`` serve both; where their defaults differ the
flag defaults to none and the mode's config fills it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from ..config import check_fields, setting
from ..demo.config import DemoConfig
from ..errors import ConfigError
from ..formats import FORMAT_NAMES
from .flags import add_config_flags, config_kwargs

__all__ = ["CODEC_SHARED", "DEMO_MODE_DEFAULTS", "CodecWalk", "register"]

_DESCRIPTION = """\
Cross-region asynchronous RL on one machine (docs/demo.md): a trainer runs GRPO on a tiny
model made locally and publishes a version after every step; three rollout islands (one
reading the board directly, two through relays behind an EMULATED WAN) serve its rollouts
through a gateway under a staleness bound; the run is shown live, checked (labels vs weights,
LATEST, catch-up, verified bytes) and reported in OUT/summary.json with plots.

--codec-only: the older codec walk-through on simulated AdamW steps (no processes)."""

#: DemoConfig fields whose flag the codec walk-through shares with another default (--steps:
#: 50 steps of RL, 4 of the walk-through): the flag defaults to none, the mode's config fills it.
DEMO_MODE_DEFAULTS = ("steps", "out")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="cross-region async RL on one machine (emulated WAN)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p, DemoConfig, unset=DEMO_MODE_DEFAULTS)
    codec = p.add_argument_group(
        "--codec-only",
        "the codec walk-through; it also reads --seed, and --steps, --lr and --out with "
        f"defaults of its own ({', '.join(_codec_defaults())})",
    )
    codec.add_argument(
        "--codec-only",
        action="store_true",
        help="run the codec walk-through on simulated AdamW steps instead",
    )
    add_config_flags(codec, CodecWalk, skip=CODEC_SHARED)
    p.set_defaults(func=cmd_demo)


def _codec_defaults() -> list[str]:
    d = CodecWalk()
    return [f"{d.steps} steps", f"lr {d.lr:g}", f"out {d.out}"]


def cmd_demo(args: argparse.Namespace) -> int:
    if args.codec_only:
        _only_codec_flags(args)
        return cmd_codec(args)
    from . import preflight

    cfg = DemoConfig(**config_kwargs(args, DemoConfig))  # a bad flag: one line, exit 2
    preflight.require_extra("reference", "rollpatch demo")  # before any process starts
    preflight.offline()  # the tiny model is made locally; nothing asks the model hub
    from ..demo import DemoFailed, run_demo

    try:
        run_demo(cfg)
    except DemoFailed as e:
        print(f"rollpatch demo: FAILED: {e}")
        return 1
    except KeyboardInterrupt:
        print("\nrollpatch demo: interrupted; every process it started has been stopped")
        return 130
    return 0


def _only_codec_flags(args: argparse.Namespace) -> None:
    """``--codec-only`` with a flag only the full demo reads: refused, not ignored."""
    from ..config import flag_name, settings

    given = config_kwargs(args, DemoConfig)
    ignored = [
        flag_name(d)
        for name, d in settings(DemoConfig).items()
        if name not in CODEC_SHARED and name in given and given[name] != d.default
    ]
    if ignored:
        raise ConfigError(
            f"--codec-only does not use {', '.join(ignored)}",
            hint="drop them, or run the full demo without --codec-only",
        )


def _names(text: str) -> tuple[str, ...]:
    return tuple(f.strip() for f in text.split(",") if f.strip())


@dataclass(frozen=True, kw_only=True)
class CodecWalk:
    """The codec walk-through's settings (``rollpatch demo --codec-only``)."""

    params: float = setting(
        20e6, lo=0.0, lo_open=True, hi=1e13, metavar="N", help="model size (parameters)"
    )
    formats: tuple[str, ...] = setting(
        ("bf16", "fp8-e4m3-block128", "nvfp4"),
        parse=_names,
        metavar="F,F,...",
        help="served formats, comma-separated",
    )
    steps: int = setting(4, lo=1, hi=100_000, help="simulated AdamW steps")
    lr: float = setting(3e-6, lo=0.0, lo_open=True, hi=1.0, help="AdamW learning rate")
    out: str = setting("out/demo-codec", help="output directory (views, patches)")
    seed: int = setting(0, lo=0, hi=2**31 - 1, help="seed of the simulated model and steps")

    def __post_init__(self) -> None:
        object.__setattr__(self, "formats", tuple(self.formats))
        check_fields(self)
        unknown = [f for f in self.formats if f not in FORMAT_NAMES]
        if not self.formats or unknown:
            raise ConfigError(
                "CodecWalk.formats must name known formats",
                field="formats",
                value=",".join(unknown),
                hint=f"one or more of {', '.join(FORMAT_NAMES)}",
            )


#: CodecWalk fields set by the RL demo's flags of the same name (none given: this default).
CODEC_SHARED = ("steps", "lr", "out", "seed")


def walk_config(args: argparse.Namespace) -> CodecWalk:
    """The walk-through's config from ``rollpatch demo``'s parsed flags."""
    shared = {k: getattr(args, k) for k in CODEC_SHARED if getattr(args, k, None) is not None}
    return CodecWalk(**config_kwargs(args, CodecWalk), **shared)


def _codec_vocab(n_params: int) -> int:
    """Vocabulary of the simulated model: Llama's 32,000 when the model is big enough to hold
    its embeddings (16.4M parameters and up), else smaller, so that embedding and lm_head stay
    at most about half the model, as in small real models (32,000 x 64 x 2 alone is 4.1M)."""
    return min(32000, max(256, n_params // 512 // 64 * 64))


def _sim_config(walk: CodecWalk) -> Any:
    from ..sim import SimConfig

    n_params = int(walk.params)
    try:
        return SimConfig(
            n_params=n_params, lr=walk.lr, seed=walk.seed, vocab=_codec_vocab(n_params)
        )
    except ValueError as e:  # SimConfig names its field; say which option that is
        raise ConfigError(
            f"--params/--lr/--seed: {e}",
            hint="e.g. --params 2e6 (at least 100,000), --lr in (0, 1), --seed >= 0",
        ) from None


def cmd_codec(args: argparse.Namespace) -> int:
    """Run the walk-through (``rollpatch demo --codec-only``)."""
    from ..errors import TargetMismatchError
    from ..formats import cast_view
    from ..io import save_view
    from ..patch import apply, compose, decode, diff, encode
    from ..sim import AdamSim

    walk = walk_config(args)
    formats = list(walk.formats)
    out = Path(walk.out)
    out.mkdir(parents=True, exist_ok=True)
    sim = AdamSim(_sim_config(walk))
    print(
        f"rollpatch demo: {sim.n_params / 1e6:.1f}M-parameter Llama-like model, AdamW "
        f"lr={walk.lr:g}, {walk.steps} steps, formats {', '.join(formats)}"
    )
    views = {f: [cast_view(sim.masters(), f)] for f in formats}
    replicas = {f: views[f][0].copy() for f in formats}
    for f in formats:
        save_view(views[f][0], out / f"{f}.v0.safetensors")
    head = (
        "step",
        "format",
        "changed %",
        "patch bytes",
        "% of view",
        "vs xor+zstd3",
        "encode ms",
        "apply ms",
    )
    print("  ".join(f"{h:>12}" for h in head))
    zc = zstandard.ZstdCompressor(level=3)
    total = 0
    for step in range(1, walk.steps + 1):
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
            xz = sum(
                len(zc.compress((prev[n].data ^ cur[n].data).tobytes()))
                for n in cur
                if n in prev and prev[n].shape == cur[n].shape
            )
            n_el = sum(t.n_elements for t in cur.values())
            row = (
                step,
                f,
                f"{100 * patch.n_changed / n_el:.3f}",
                f"{len(blob):,}",
                f"{100 * len(blob) / cur.nbytes:.3f}",
                f"{len(blob) / max(xz, 1):.3f}x",
                f"{1e3 * (t1 - t0):.0f}",
                f"{1e3 * (t2 - t1):.0f}",
            )
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
        print(
            f"{f}: replica {walk.steps} versions behind catches up with one composed patch "
            f"of {len(blob):,} bytes ({100 * len(blob) / lagging.nbytes:.3f}% of the view), "
            "bit-exact"
        )
    print(f"all {total} transitions verified bit-exact; patches and keyframes in {out}/")
    return 0
