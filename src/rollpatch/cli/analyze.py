"""``rollpatch analyze``: what rollpatch would ship over a run of your own checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ConfigError
from .codec import policy_from_args, quant_args

__all__ = ["register"]


def register(sub: Any) -> None:
    from ..formats import FORMAT_NAMES

    p = sub.add_parser(
        "analyze",
        help="measure changed values, patch sizes and the lag curve over a run",
        description="Per consecutive pair of master checkpoints (oldest first) and per served "
        "format: changed values (whole model and by tensor group), the real patch "
        "size against the i.i.d. bound and XOR+zstd-3, master updates against the "
        "rounding gap, and the lag curve. See docs/analyze.md.",
    )
    p.add_argument(
        "ckpts",
        nargs="+",
        metavar="CKPT",
        help="master checkpoints of one run, oldest first: .safetensors, torch "
        "state dicts (.pt/.pth/.bin/.ckpt, needs torch), or folders of "
        "such shards",
    )
    p.add_argument(
        "--format",
        action="append",
        choices=FORMAT_NAMES,
        dest="formats",
        metavar="FORMAT",
        help=f"served format (repeatable; default bf16): {', '.join(FORMAT_NAMES)}",
    )
    quant_args(p)
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument("--plot", metavar="PNG", help="also write a figure (needs matplotlib)")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is shown on stderr only when that is a terminal)",
    )
    p.set_defaults(func=cmd_analyze)


def cmd_analyze(args: argparse.Namespace) -> int:
    from ..analysis import analyze_run, render
    from ..analysis.plot import require_matplotlib, write_plot

    if len(args.ckpts) < 2:
        raise ConfigError(
            "analyze needs at least two checkpoints",
            count=len(args.ckpts),
            hint="pass consecutive checkpoints of one run, oldest first",
        )
    if args.plot:
        from .preflight import output_file

        require_matplotlib(args.plot)  # fail before the long part, not after it
        output_file(args.plot, option="--plot")
    policy = policy_from_args(args)
    result = analyze_run(
        args.ckpts,
        formats=args.formats or ["bf16"],
        scales=args.scales,
        policy=policy,
        progress=False if args.no_progress else None,
    )
    from .casting import warn_quantised

    for fmt, n in result.quantised.items():
        warn_quantised(fmt, n, result.tensors)
    if args.plot:
        write_plot(result, args.plot)
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1, allow_nan=False)
        print()
    else:
        print(render(result))
        if result.skipped:  # what cast, diff and publish do with them (docs/analyze.md)
            print(
                "note: tensors left out are not served: cast, diff and publish refuse a "
                "checkpoint holding them (save it without its buffers, in float32 or bfloat16)"
            )
        if args.plot:
            print(f"figure: {args.plot}")
    return 0
