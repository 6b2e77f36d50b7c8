"""The tables of ``bench/sglang.py``: a commit's pause by part, and the printed report."""

from __future__ import annotations

import statistics
from typing import Any

from _util import machine_line, table

SGLANG_VERSION = "0.5.23"

#: The pause's parts (ms): SGLang's routes under the pause, rollpatch's command inside one.
PAUSE_PARTS = ("pause", "session", "route", "command", "version", "continue", "other")


def pause_parts(routes: dict[str, float], command_ms: float, held_s: float) -> dict[str, float]:
    """A commit's pause (``held_s``) by part: ``pause``/``continue`` (SGLang's pause routes),
    ``command`` (rollpatch's commit inside SGLang: the writes and their read-back, or the
    exchange), ``route`` (the rest of ``/update_weights_from_tensor``: SGLang's IPC to the
    scheduler and its cache flush), ``version`` (``/update_weight_version``), ``other`` (the
    rest: the adapter's checks, ...), ``session`` (``/begin_weight_update`` and
    ``/end_weight_update``)."""
    tensor = routes.get("/update_weights_from_tensor", 0.0)
    parts = {
        "pause_ms": routes.get("/pause_generation", 0.0),
        "route_ms": tensor - command_ms if tensor else 0.0,
        "command_ms": command_ms,
        "version_ms": routes.get("/update_weight_version", 0.0),
        "continue_ms": routes.get("/continue_generation", 0.0),
    }
    parts["session_ms"] = routes.get("/begin_weight_update", 0.0) + routes.get(
        "/end_weight_update", 0.0
    )
    parts["other_ms"] = held_s * 1e3 - sum(parts.values())
    return parts


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def render(ctx: dict[str, Any]) -> str:
    st, db, rl, w = ctx["staged"], ctx["double"], ctx["reloads"], ctx["world"]

    def med(runs: list[dict[str, float]], k: str) -> float:
        return statistics.median(r[k] for r in runs)

    p_rl = med(rl, "pause_s")
    rows = [
        [
            name,
            _ms(med(runs, "pause_s")),
            _ms(max(r["pause_s"] for r in runs)),
            _ms(med(runs, "stage_s")),
            _ms(med(runs, "visible_s")),
            _mb(med(runs, "bytes")),
            f"{med(runs, 'pause_s') / p_rl:.3f}",
        ]
        for name, runs in (("rollpatch staged, in place", st), ("rollpatch double-buffered", db))
    ]
    rows += [
        [
            "SGLang update_weights_from_disk",
            _ms(p_rl),
            _ms(max(r["pause_s"] for r in rl)),
            "-",
            _ms(p_rl),
            _mb(med(rl, "bytes")),
            "1.000",
        ],
    ]
    head = (
        f"SGLang {SGLANG_VERSION} CPU, TP {ctx['args'].get('tp', 1)}, {w['params'] / 1e6:.1f}M params "
        f"(hidden {w['dims']['hidden_size']}, {w['dims']['layers']} layers), BF16, "
        f"{len(st)} versions, lr {ctx['args']['lr']}, changed/step median "
        f"{100 * statistics.median(w['changed'][1:]):.2f}%; server start "
        f"{ctx['start_s']:.0f} s; load avg {ctx['load'][0]:.1f} -> {ctx['load'][1]:.1f}\n"
        f"{machine_line(ctx['machine'])}"
    )
    t = table(
        [
            "path",
            "pause p50",
            "pause max",
            "stage p50",
            "visible->serving p50",
            "bytes moved / version",
            "pause / reload",
        ],
        rows,
        [False, True, True, True, True, True, True],
    )
    phases = ["gather", "decode", "prove", "layout", "buffers", "transfer"]
    t2 = table(
        ["stage breakdown, ms p50", *phases, "stage"],
        [
            [
                name,
                *(f"{med(runs, f'{k}_ms'):.0f}" for k in phases),
                f"{med(runs, 'stage_s') * 1e3:.0f}",
            ]
            for name, runs in (("in place", st), ("double-buffered", db))
        ],
        [False, *([True] * (len(phases) + 1))],
    )
    t3 = table(
        ["pause breakdown, ms p50", *PAUSE_PARTS, "pause"],
        [
            [
                name,
                *(f"{med(runs, f'{k}_ms'):.1f}" for k in PAUSE_PARTS),
                f"{med(runs, 'pause_s') * 1e3:.0f}",
            ]
            for name, runs in (("in place", st), ("double-buffered", db), ("reload", rl))
        ],
        [False, *([True] * (len(PAUSE_PARTS) + 1))],
    )
    out = (
        f"{head}\n{t}\n(staged update held in SGLang: median {_mb(med(st, 'staged_bytes'))}"
        f", {int(med(st, 'changed'))} changed elements per version)\n{t2}\n{t3}\n"
        "(command: rollpatch's commit inside SGLang, for the reload SGLang's own; route: the "
        "rest of /update_weights_from_tensor)"
    )
    ch = ctx.get("chain") or {}
    if not ch:
        return out
    one = med(st, "visible_s")

    def row(name: str, runs: list[dict[str, float]]) -> list[str]:
        def part(k: str) -> str:
            return f"{med(runs, k):.0f} ms" if k in runs[0] else "-"

        return [
            name,
            str(len(runs)),
            _ms(med(runs, "stage_s")),
            part("gather_ms"),
            part("decode_ms"),
            _ms(med(runs, "pause_s")),
            _ms(med(runs, "visible_s")),
            f"{med(runs, 'visible_s') / one:.2f}x",
        ]

    rows = [row("1 behind (the staged path above)", st)]
    for n in sorted({int(k[len("inside") :]) for k in ch if k.startswith("inside")}):
        what = "one step" if n == 1 else "chain"
        rows.append(row(f"{n} behind from v0: {what} decoded in SGLang", ch[f"inside{n}"]))
        if f"folded{n}" in ch:
            rows.append(row(f"{n} behind from v0 (anchor): folded patch", ch[f"folded{n}"]))
        rows.append(row(f"{n} behind from v0: follower, exported words", ch[f"follower{n}"]))
    t4 = table(
        [
            "catch-up, in place",
            "n",
            "stage p50",
            "gather p50",
            "decode p50",
            "pause p50",
            "visible->serving p50",
            "/ 1 behind",
        ],
        rows,
        [False, True, True, True, True, True, True, True],
    )
    return (
        f"{out}\n{t4}\n(gather, decode: inside SGLang; the follower's decode and the words' "
        "export happen in the bench's process, in its stage time)"
    )
