"""bench/vllm.py's report: the tables of pauses, staging and targets (see that module)."""

from __future__ import annotations

import statistics
from typing import Any

from _util import machine_line, table
from _vllm_catchup import render_plans
from _vllm_catchup_table import _med, _ms, _pct, one_behind, render_catchup
from _vllm_floor import render_floor
from _vllm_fold import render_fold
from _vllm_server import VLLM_VERSION

#: The pause's parts (ms, medians), in the order they happen; each path shows those it has.
PHASES = [
    ("pause_call_ms", "/pause"),
    ("rpc_ms", "commit call"),
    ("core_ms", "engine hold"),
    ("worker_ms", "worker"),
    ("write_ms", "write+read-back"),
    ("derived_ms", "packed"),
    ("exchange_ms", "exchange"),
    ("tag_ms", "/tag"),
    ("reset_ms", "/reset cache"),
    ("resume_call_ms", "/resume"),
    ("after_pause_ms", "(after: kernel-only words)"),
]


#: Where the staging (while vLLM serves) goes, in the worker (ms, medians).
STAGE_PHASES = [
    ("decode_ms", "decode (+compose)"),
    ("gather_ms", "of it (TP > 1): gather to owners"),
    ("gather_wait_ms", "gather: wait"),
    ("assemble_ms", "gather: assemble"),
    ("own_decode_ms", "own decodes"),
    ("share_ms", "share"),
    ("prove_ms", "prove"),
    ("layout_ms", "layout"),
    ("buffers_ms", "second buffers"),
    ("prebuild_ms", "packed kernels"),
]


#: The worker's resident set by staging phase (MiB above the staging start, peak in each).
MEMORY_PHASES = [
    ("decode_mib", "decode (+compose)"),
    ("prove_mib", "prove"),
    ("layout_mib", "layout"),
    ("buffers_mib", "second buffers"),
    ("prebuild_mib", "packed kernels"),
    ("held_mib", "held at commit"),
]


def render_memory(paths: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """The worker's memory while staging, by phase (medians of each phase's peak), against
    the staged update and the promise (2x it); the last column: the peak without the packed
    kernels' phase (what decode, compose, proof and layout take)."""
    rows = []
    for name, runs in paths:
        if not runs:
            continue  # a path this run did not take
        mems = [r.get("stage_memory_mib") or {} for r in runs]
        cells = [name, _mb(statistics.median(r["staged_bytes"] for r in runs))]
        for key, _ in MEMORY_PHASES:
            vals = [m[key] for m in mems if key in m]
            cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
        core = [max(m.get(k, 0.0) for k in ("decode_mib", "prove_mib", "layout_mib")) for m in mems]
        cells.append(f"{statistics.median(core):.1f}" if core else "-")
        rows.append(cells)
    return table(
        ["worker memory while staging, MiB", "staged update"]
        + [label for _, label in MEMORY_PHASES]
        + ["peak before kernels"],
        rows,
        [False] + [True] * (len(MEMORY_PHASES) + 2),
    )


def _breakdown(
    paths: list[tuple[str, list[dict[str, Any]]]],
    *,
    title: str,
    total: str,
    parts: str,
    phases: list[tuple[str, str]],
    digits: int,
) -> str:
    """One row per path: the median of ``total`` (seconds) and of each part (ms) it has."""
    rows = []
    for name, runs in paths:
        if not runs:
            continue  # a path this run did not take
        cells = [name, _ms(_med(runs, total))]
        for key, _ in phases:
            vals = [r[parts][key] for r in runs if key in r.get(parts, {})]
            cells.append(f"{statistics.median(vals):.{digits}f}" if vals else "-")
        rows.append(cells)
    return table(
        [title, total.removesuffix("_s") + " p50"] + [label for _, label in phases],
        rows,
        [False] + [True] * (len(phases) + 1),
    )


def render_stage(paths: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """Staging per path: the follower's figure and the worker's parts."""
    return _breakdown(
        paths,
        title="staging breakdown, ms",
        total="stage_s",
        parts="stage_phases_ms",
        phases=STAGE_PHASES,
        digits=0,
    )


def render_phases(paths: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """Where each path's pause goes: one row per path, medians of the parts it has."""
    return _breakdown(
        paths,
        title="pause breakdown, ms",
        total="pause_s",
        parts="phases_ms",
        phases=PHASES,
        digits=1,
    )


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def render(ctx: dict[str, Any]) -> str:
    w, st, il, re_ = ctx["world"], ctx["staged"], ctx["inline"], ctx["reloads"]
    headers = [
        "version",
        "changed",
        "patch",
        "stage",
        "pause",
        "visible->serving",
        "inline pause",
        "reload pause",
        "pause/reload",
    ]
    rows = [
        [
            f"v{i}",
            f"{100 * w['changed'][i]:.2f}%",
            f"{w['patch_bytes'][i] / 1e3:.0f} kB",
            _ms(st[i - 1]["stage_s"]),
            _ms(st[i - 1]["pause_s"]),
            _ms(st[i - 1]["visible_to_serving_s"]),
            _ms(il[i - 1]["pause_s"]),
            _ms(re_[i - 1]["pause_s"]),
            f"{100 * st[i - 1]['pause_s'] / re_[i - 1]['pause_s']:.1f}%",
        ]
        for i in range(1, len(st) + 1)
    ]
    rows.append(
        [
            "median",
            f"{100 * statistics.median(w['changed'][1:]):.2f}%",
            f"{statistics.median(w['patch_bytes'][1:]) / 1e3:.0f} kB",
            _ms(_med(st, "stage_s")),
            _ms(_med(st, "pause_s")),
            _ms(_med(st, "visible_to_serving_s")),
            _ms(_med(il, "pause_s")),
            _ms(_med(re_, "pause_s")),
            f"{100 * _med(st, 'pause_s') / _med(re_, 'pause_s'):.1f}%",
        ]
    )
    per_version = table(headers, rows, [False] + [True] * (len(headers) - 1))

    def taken(rows: list[list[str]]) -> list[list[str]]:
        return [r for r in rows if r]  # a path this run did not take has no row

    def row(name: str, runs: list[dict[str, float]], base: float) -> list[str]:
        if not runs:
            return []
        p = [r["pause_s"] for r in runs]
        vis = [r.get("visible_to_serving_s") for r in runs]
        return [
            name,
            str(len(runs)),
            _ms(statistics.median(p)),
            _ms(max(p)),
            _ms(statistics.median(v for v in vis if v is not None)) if vis[0] else "-",
            f"{100 * statistics.median(p) / base:.1f}%",
        ]

    rv, rl = _med(re_, "pause_s"), _med(ctx["reference_loads"], "pause_s")
    summary = table(
        [
            "engine / path",
            "n",
            "pause p50",
            "pause max",
            "visible->serving p50",
            "pause / full reload",
        ],
        taken(
            [
                row("vLLM staged, 1 behind", st, rv),
                row("vLLM staged, double-buffered", ctx["double"], rv),
                row("vLLM inline (decode in pause)", il, rv),
                row(f"vLLM staged, {ctx['catchup_n']} behind", ctx["catchup"], rv),
                *(
                    [row(f"vLLM staged, {ctx['catchup_n']} behind, chain", chain, rv)]
                    if (chain := ctx.get("catchup_chain"))
                    else []
                ),
                row("vLLM reload_weights", re_, rv),
                row("built-in staged, 1 behind", ctx["reference"], rl),
                row("built-in staged, double-buffered", ctx["reference_double"], rl),
                row(f"built-in staged, {ctx['catchup_n']} behind", ctx["reference_catchup"], rl),
                *(
                    [row(f"built-in staged, {ctx['catchup_n']} behind, chain", rchain, rl)]
                    if (rchain := ctx.get("reference_catchup_chain"))
                    else []
                ),
                *(
                    [row(f"built-in staged, {ctx['catchup_n']} behind, rewind", rfold, rl)]
                    if (rfold := ctx.get("reference_catchup_followed"))
                    else []
                ),
                row("built-in full load (keyframe)", ctx["reference_loads"], rl),
            ]
        ),
        [False] + [True] * 5,
    )
    catchup = render_catchup(ctx)
    if catchup:
        summary += "\n\n" + catchup
    breakdown = render_phases(
        [
            ("vLLM staged, 1 behind", st),
            ("vLLM staged, double-buffered", ctx["double"]),
            (f"vLLM staged, {ctx['catchup_n']} behind", ctx["catchup"]),
            ("vLLM inline (decode in pause)", il),
            ("vLLM reload_weights", re_),
        ]
    )
    breakdown += "\n\n" + render_stage(
        [
            ("vLLM staged, 1 behind", st),
            ("vLLM staged, double-buffered", ctx["double"]),
            (f"vLLM staged, {ctx['catchup_n']} behind", ctx["catchup"]),
        ]
    )
    if any("stage_memory_mib" in r for r in st):
        breakdown += "\n\n" + render_memory(
            [
                ("vLLM staged, 1 behind", st),
                ("vLLM staged, double-buffered", ctx["double"]),
                (f"vLLM staged, {ctx['catchup_n']} behind", ctx["catchup"]),
            ]
        )
    m, d = ctx["memory"], w["dims"]
    one = _med(one_behind(ctx), "visible_to_serving_s")
    five = _med(ctx["catchup"], "visible_to_serving_s")
    rone = _med(one_behind(ctx, "reference_"), "visible_to_serving_s")
    rfive = _med(ctx["reference_catchup"], "visible_to_serving_s")
    biggest = max(r["staged_bytes"] for r in st)
    foot = [
        "",
        (
            f"targets: vLLM pause 1 behind / reload pause = {100 * _med(st, 'pause_s') / rv:.1f}%"
            f" in place, {_pct(_med(ctx['double'], 'pause_s'), rv)} double-buffered;"
            f" built-in / full load {100 * _med(ctx['reference'], 'pause_s') / rl:.1f}% in place,"
            f" {100 * _med(ctx['reference_double'], 'pause_s') / rl:.1f}% double-buffered"
            f" (<= 5% wanted at >= 100M); catch-up {ctx['catchup_n']} behind / 1 behind, "
            f"visible->serving: vLLM {five / one:.2f}x, built-in {rfive / rone:.2f}x (<= 2x)"
            + (
                f" from v0; from v1 (chain) vLLM "
                f"{_med(ctx['catchup_chain'], 'visible_to_serving_s') / one:.2f}x, built-in "
                f"{_med(ctx['reference_catchup_chain'], 'visible_to_serving_s') / rone:.2f}x"
                + (
                    ", built-in followed from v0 (rewind + fold) "
                    f"{_med(ctx['reference_catchup_followed'], 'visible_to_serving_s') / rone:.2f}x"
                    if ctx.get("reference_catchup_followed")
                    else ""
                )
                + "; "
                if ctx.get("catchup_chain") and ctx.get("reference_catchup_chain")
                else "; "
            )
            + f"worker peak over the staged phase +{_mb(m['peak_kb'] * 1024)} in place, "
            + (
                f"+{_mb(m['double_peak_kb'] * 1024)} double-buffered, "
                if ctx["double"]
                else "(no double-buffered commits at TP > 1), "
            )
            + "vs 2 x largest "
            f"staged update {_mb(2 * biggest)} (<= wanted)"
        ),
        (
            f"machine: {machine_line(ctx['machine'])}; load avg {ctx['load'][0]:.1f} at start, "
            f"{ctx['load'][1]:.1f} at end (shared: compare rows of this run only); "
            f"{ctx['wall_s'] / 60:.1f} min wall, vLLM start {ctx['start_s']:.0f} s"
        ),
        (
            f"model: make_tiny_model hidden {d['hidden_size']}, {d['layers']} layers, "
            f"{d['heads']}/{d['kv_heads']} heads, ff {d['intermediate']}, vocab {d['vocab_size']}"
            f" = {w['params'] / 1e6:.1f}M params, {w['ckpt_bytes'][0] / 1e6:.1f} MB bf16; vLLM "
            f"{VLLM_VERSION} CPU, TP {ctx['args'].get('tp', 1)}, --enforce-eager; "
            f"AdamW lr {ctx['args']['lr']:g}; "
            f"packed weights built "
            f"{'while staging' if ctx['args']['prepack'] == 'stage' else 'in the pause'}; ms"
        ),
        (
            "stage = the follower's staging (worker decode/compose/prove while serving); pause = "
            "the commit gate's figure; visible->serving = Follower.sync (fetch+stage+pause)"
        ),
        (
            f"memory: vLLM worker ({m['proc']}) RSS {_mb(m['start_kb'] * 1024)} at the staged "
            f"phase start, peak +{_mb(m['peak_kb'] * 1024)} over it; largest staged update "
            f"{_mb(biggest)} (positions, storage offsets, old and new words; the prebuilt "
            "packed kernels are not counted in it)"
        ),
        render_floor(ctx.get("reference_floor"), rl),
        (
            "verified: every commit's digest = published; greedy tokens+logprobs after each "
            "staged commit = after the reload of that version; reloaded roots re-hashed = "
            "published"
        ),
    ]
    plans = render_plans(ctx.get("catchup_plans") or {})
    folds = render_fold(ctx.get("fold_costs") or {})
    if folds:
        plans = (plans + "\n\n" if plans else "") + folds
    return (
        per_version
        + "\n\n"
        + summary
        + "\n\n"
        + breakdown
        + "\n"
        + "\n".join(foot)
        + ("\n\n" + plans if plans else "")
    )


# -- main ----------------------------------------------------------------------------------------
