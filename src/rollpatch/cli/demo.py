"""``rollpatch demo``: cross-region asynchronous RL on one machine (docs/demo.md).

By default: a trainer runs GRPO on a tiny model made locally and publishes a version after
every step; three rollout islands (one reading the board directly, two through relays behind
an *emulated* WAN) serve its rollouts through a gateway under a staleness bound; the run is
shown live, checked (labels vs weights, LATEST, catch-up, verified bytes) and reported.

``--codec-only``: the older codec walk-through — simulated AdamW steps cast to the served
formats, diffed, encoded, decoded on a replica and verified bit for bit (no processes).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import zstandard

__all__ = ["register"]

_DESCRIPTION = """\
Cross-region asynchronous RL on one machine (docs/demo.md): a trainer runs GRPO on a tiny
model made locally and publishes a version after every step; three rollout islands (one
reading the board directly, two through relays behind an EMULATED WAN) serve its rollouts
through a gateway under a staleness bound; the run is shown live, checked (labels vs weights,
LATEST, catch-up, verified bytes) and reported in OUT/summary.json with plots.

--codec-only: the older codec walk-through on simulated AdamW steps (no processes)."""
_RL_STEPS, _CODEC_STEPS = 50, 4
_RL_LR, _CODEC_LR = {"fast": 2e-4, "real": 1.5e-6}, 3e-6


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="cross-region async RL on one machine (emulated WAN)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--steps",
        type=int,
        help=f"training steps (default {_RL_STEPS}; --codec-only: {_CODEC_STEPS})",
    )
    p.add_argument(
        "--max-lag",
        type=int,
        default=2,
        help="staleness bound K: requests carry max_lag=K, older rollouts are dropped",
    )
    p.add_argument("--format", default="bf16", help="served format the trainer publishes")
    p.add_argument(
        "--wan-mbps",
        type=float,
        default=10.0,
        help="emulated WAN bandwidth board -> each remote relay (Mbit/s)",
    )
    p.add_argument(
        "--wan-latency-ms",
        type=float,
        default=100.0,
        help="emulated WAN round trip added (ms; half each way, real TCP through rollpatch.netem)",
    )
    p.add_argument(
        "--out",
        help="output directory, reset on every run (default out/demo; "
        "--codec-only: out/demo-codec)",
    )
    p.add_argument("--json", dest="json_path", help="also write the JSON report here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-live",
        action="store_true",
        help="print one line per step instead of a live status block",
    )
    p.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="rollout engine of the islands",
    )
    p.add_argument(
        "--engine-urls",
        default="",
        help="--engine vllm: three comma-separated OpenAI base URLs (local,eu,us)",
    )
    p.add_argument("--prompts-per-step", type=int, default=16, help="GRPO groups per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    p.add_argument(
        "--regime",
        choices=("fast", "real"),
        default="fast",
        help="fast: format warm-up only, high learning rate, reward climbs within "
        "~50 steps, ~50%% of the BF16 values change per step; real: an "
        "unpublished supervised warm-up, then RL at a post-training learning "
        "rate (a few %% change per step; the reward moves slowly: docs/demo.md)",
    )
    p.add_argument(
        "--lr",
        type=float,
        help=f"learning rate (default fast {_RL_LR['fast']:g}, real "
        f"{_RL_LR['real']:g}; --codec-only: {_CODEC_LR:g})",
    )
    p.add_argument("--hidden", type=int, default=128, help="tiny model hidden size")
    p.add_argument(
        "--model",
        choices=("dense", "moe"),
        default="dense",
        help="dense: a tiny Llama; moe: a tiny Qwen3-MoE (8 experts, top-2) whose responses "
        "carry routed_experts, replayed by transformers under their labelled versions",
    )
    p.add_argument(
        "--verify-samples",
        type=int,
        default=0,
        help="rollouts to re-generate for the label check (0: all)",
    )
    codec = p.add_argument_group("--codec-only")
    codec.add_argument(
        "--codec-only",
        action="store_true",
        help="run the codec walk-through on simulated AdamW steps instead",
    )
    codec.add_argument("--params", type=float, default=20e6, help="model size (parameters)")
    codec.add_argument("--formats", default="bf16,fp8-e4m3-block128,nvfp4")
    p.add_argument(
        "--no-sign",
        action="store_true",
        help="publish an unsigned board (default: a key and a trust root are made "
        "for the run; relays and islands verify every manifest and LATEST)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.codec_only:
        return cmd_codec(args)
    from . import preflight

    preflight.require_extra("reference", "rollpatch demo")  # before any process starts
    preflight.offline()  # the tiny model is made locally; nothing asks the model hub
    from ..demo import DemoConfig, DemoFailed, run_demo

    cfg = DemoConfig(
        steps=args.steps if args.steps is not None else _RL_STEPS,
        max_lag=args.max_lag,
        format=args.format,
        wan_mbps=args.wan_mbps,
        wan_latency_ms=args.wan_latency_ms,
        out=args.out or "out/demo",
        json_path=args.json_path,
        seed=args.seed,
        live=not args.no_live,
        engine=args.engine,
        engine_urls=tuple(u.strip() for u in args.engine_urls.split(",") if u.strip()),
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        regime=args.regime,
        lr=args.lr if args.lr is not None else _RL_LR[args.regime],
        hidden=args.hidden,
        model=args.model,
        verify_samples=args.verify_samples,
        sign=not args.no_sign,
    )
    try:
        run_demo(cfg)
    except DemoFailed as e:
        print(f"rollpatch demo: FAILED: {e}")
        return 1
    except KeyboardInterrupt:
        print("\nrollpatch demo: interrupted; every process it started has been stopped")
        return 130
    return 0


def _codec_vocab(n_params: int) -> int:
    """Vocabulary of the simulated model: Llama's 32,000 when the model is big enough to hold
    its embeddings (16.4M parameters and up), else smaller, so that embedding and lm_head stay
    at most about half the model, as in small real models (32,000 x 64 x 2 alone is 4.1M)."""
    return min(32000, max(256, n_params // 512 // 64 * 64))


def _sim_config(args: argparse.Namespace) -> Any:
    from ..errors import ConfigError
    from ..sim import SimConfig

    n_params = int(args.params)
    try:
        return SimConfig(
            n_params=n_params, lr=args.lr, seed=args.seed, vocab=_codec_vocab(n_params)
        )
    except ValueError as e:  # SimConfig names its field; say which option that is
        raise ConfigError(
            f"--params/--lr/--seed: {e}",
            hint="e.g. --params 2e6 (at least 100,000), --lr in (0, 1), --seed >= 0",
        ) from None


def cmd_codec(args: argparse.Namespace) -> int:
    from ..errors import ConfigError, TargetMismatchError
    from ..formats import cast_view
    from ..io import save_view
    from ..patch import apply, compose, decode, diff, encode
    from ..sim import AdamSim

    args.steps = args.steps if args.steps is not None else _CODEC_STEPS
    args.lr = args.lr if args.lr is not None else _CODEC_LR
    if args.steps < 1:
        raise ConfigError("--steps must be at least 1")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    out = Path(args.out or "out/demo-codec")
    out.mkdir(parents=True, exist_ok=True)
    sim = AdamSim(_sim_config(args))
    print(
        f"rollpatch demo: {sim.n_params / 1e6:.1f}M-parameter Llama-like model, AdamW "
        f"lr={args.lr:g}, {args.steps} steps, formats {', '.join(formats)}"
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
            f"{f}: replica {args.steps} versions behind catches up with one composed patch "
            f"of {len(blob):,} bytes ({100 * len(blob) / lagging.nbytes:.3f}% of the view), "
            "bit-exact"
        )
    print(f"all {total} transitions verified bit-exact; patches and keyframes in {out}/")
    return 0
