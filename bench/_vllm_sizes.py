"""bench/vllm.py over several model sizes: each size run in its own process (a 400M model's
world and server give their memory back between sizes), then one table of every size.

``--sizes 512x4,1024x8,2048x9`` runs them in that order; ``--combine A.json B.json ...``
prints the table from runs kept with ``--json`` (each file is one size's full report, the
same JSON a single run writes).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _util import log, table
from _vllm_catchup_table import _med, _ms, _pct, one_behind
from _vllm_server import BenchError

#: (path key in the JSON, label, its full-reload baseline key).
PATHS = [
    ("staged", "vLLM staged, 1 behind", "reloads"),
    ("double", "vLLM staged, double-buffered", "reloads"),
    ("catchup", "vLLM staged, {n} behind", "reloads"),
    ("catchup_chain", "vLLM staged, {n} behind, chain", "reloads"),
    ("inline", "vLLM inline (decode in pause)", "reloads"),
    ("reloads", "vLLM reload_weights", "reloads"),
    ("reference", "built-in staged, 1 behind", "reference_loads"),
    ("reference_double", "built-in staged, double-buffered", "reference_loads"),
    ("reference_catchup", "built-in staged, {n} behind", "reference_loads"),
    ("reference_catchup_chain", "built-in staged, {n} behind, chain", "reference_loads"),
    ("reference_catchup_followed", "built-in staged, {n} behind, rewind", "reference_loads"),
    ("reference_loads", "built-in full load (keyframe)", "reference_loads"),
]


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"512x4,1024x8"`` -> ``[(512, 4), (1024, 8)]`` (hidden x layers)."""
    out = []
    for item in text.split(","):
        hidden, sep, layers = item.strip().partition("x")
        if not sep or not hidden.isdigit() or not layers.isdigit():
            raise ValueError(f"--sizes: {item!r} is not HIDDENxLAYERS (e.g. 2048x9)")
        out.append((int(hidden), int(layers)))
    return out


def size_json(base: str | None, hidden: int, layers: int, tmp: Path) -> Path:
    """Where one size's JSON goes: ``base`` with ``-h{hidden}l{layers}`` before its suffix
    (a temporary file when no ``--json`` was given)."""
    if base is None:
        return tmp / f"vllm-h{hidden}l{layers}.json"
    p = Path(base)
    return p.with_name(f"{p.stem}-h{hidden}l{layers}{p.suffix or '.json'}")


def run_sizes(
    script: Path, sizes: list[tuple[int, int]], args: Sequence[str], out: list[Path]
) -> None:
    """Run ``script`` once per size in a fresh interpreter; its tables go to our stdout."""
    for (hidden, layers), path in zip(sizes, out):
        log(f"size {hidden}x{layers}: {script.name} --hidden {hidden} --layers {layers}")
        cmd = [sys.executable, str(script), "--hidden", str(hidden), "--layers", str(layers)]
        rc = subprocess.call([*cmd, *args, "--json", str(path)])
        if rc:
            raise BenchError(f"size {hidden}x{layers} failed with exit status {rc}")
        sys.stdout.flush()


def _mib(kb: float) -> str:
    return f"{kb / 1024:.0f}"


def _stage_mib(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> str:
    """The worker's own trace of its staging runs: the median over runs of the peak (MiB
    above the run's start) over the phases ``keys``."""
    peaks = [
        max(m[k] for k in keys if k in m)
        for m in (r.get("stage_memory_mib") or {} for r in runs)
        if any(k in m for k in keys)
    ]
    return f"+{statistics.median(peaks):.0f}" if peaks else "-"


def _model(ctx: dict[str, Any]) -> str:
    d = ctx["world"]["dims"]
    return f"{ctx['world']['params'] / 1e6:.0f}M ({d['hidden_size']}x{d['layers']})"


def _ratio(ctx: dict[str, Any], key: str, one: float) -> str:
    """A catch-up path's visible->serving p50 over 1 behind's ("-": not in this run)."""
    runs = ctx.get(key)
    return f"{_med(runs, 'visible_to_serving_s') / one:.2f}x" if runs else "-"


def render_sizes(ctxs: list[dict[str, Any]]) -> str:
    """Two tables over every size: the pause of each path (p50, max, against the engine's
    full reload) with visible->serving; then the issue's targets and the worker's memory."""
    rows = []
    for ctx in ctxs:
        n, load = ctx["catchup_n"], ctx["load"]
        for key, label, base in PATHS:
            runs = ctx.get(key)
            if not runs:  # a run from before the path existed (chain: before fold_every)
                continue
            p = [float(r["pause_s"]) for r in runs]
            vis = [r["visible_to_serving_s"] for r in runs if "visible_to_serving_s" in r]
            hold = [r["phases_ms"]["core_ms"] for r in runs if "core_ms" in r.get("phases_ms", {})]
            rows.append(
                [
                    _model(ctx),
                    f"{load[0]:.1f}-{load[1]:.1f}",
                    label.format(n=n),
                    str(len(runs)),
                    _ms(statistics.median(p)),
                    _ms(max(p)),
                    f"{statistics.median(hold):.1f}" if hold else "-",
                    _ms(statistics.median(vis)) if vis else "-",
                    f"{100 * statistics.median(p) / _med(ctx[base], 'pause_s'):.1f}%",
                ]
            )
    pauses = table(
        [
            "model",
            "load",
            "engine / path",
            "n",
            "pause p50",
            "pause max",
            "engine hold p50",
            "visible->serving p50",
            "pause / full reload",
        ],
        rows,
        [False, True, False, True, True, True, True, True, True],
    )
    rows = []
    for ctx in ctxs:
        rv, rl = _med(ctx["reloads"], "pause_s"), _med(ctx["reference_loads"], "pause_s")
        one = _med(one_behind(ctx), "visible_to_serving_s")
        five = _med(ctx["catchup"], "visible_to_serving_s")
        rone = _med(one_behind(ctx, "reference_"), "visible_to_serving_s")
        rfive = _med(ctx["reference_catchup"], "visible_to_serving_s")
        chain = _ratio(ctx, "catchup_chain", one)
        rchain = _ratio(ctx, "reference_catchup_chain", rone)
        m = ctx["memory"]
        staged = max(int(r["staged_bytes"]) for r in ctx["staged"])
        weights = ctx["world"]["ckpt_bytes"][0]
        rows.append(
            [
                _model(ctx),
                f"{100 * _med(ctx['staged'], 'pause_s') / rv:.1f}%",
                _pct(_med(ctx["double"], "pause_s"), rv),
                f"{100 * _med(ctx['reference'], 'pause_s') / rl:.1f}%",
                f"{100 * _med(ctx['reference_double'], 'pause_s') / rl:.1f}%",
                f"{five / one:.2f}x",
                chain,
                f"{rfive / rone:.2f}x",
                rchain,
                _mib(m["start_kb"]),
                _mib(weights / 1024),
                f"+{_mib(m['peak_kb'])}",
                f"+{_mib(m['double_peak_kb'])}" if ctx["double"] else "-",
                _stage_mib(ctx["staged"], ("decode_mib", "prove_mib", "layout_mib")),
                _stage_mib(ctx["staged"], ("prebuild_mib",)),
                _mib(2 * staged / 1024),
            ]
        )
    targets = table(
        [
            "model",
            "vLLM in place / reload",
            "vLLM double / reload",
            "built-in in place / load",
            "built-in double / load",
            "catch-up vLLM",
            "chain vLLM",
            "catch-up built-in",
            "chain built-in",
            "worker RSS MiB",
            "weights MiB",
            "peak in place",
            "peak double",
            "staging peak",
            "with kernels",
            "2x staged",
        ],
        rows,
        [False] + [True] * 15,
    )
    notes = [
        (
            "targets: pause 1 behind <= 5% of the full reload at >= 100M; catch-up "
            f"{ctxs[0]['catchup_n']} behind / 1 behind (visible->serving p50) <= 2x (catch-up: "
            f"from v0, an anchor when fold_every = {ctxs[0].get('fold_every', 0)} > 0, one "
            "folded patch; chain: from v1, the step patches); worker "
            "peak over the staged phase (VmHWM above its RSS at the phase start, which holds "
            "the weights) <= 2x the largest staged update; staging peak: the worker's own trace of "
            "a 1-behind staging (decode, prove, layout), with kernels: its peak while the "
            "touched modules' packed kernels are prebuilt (a second copy of each, swapped in "
            "under the pause)"
        ),
        (
            "pause: the commit gate's figure (with vLLM's engine-core hook, the whole commit "
            "call, HTTP and process hops included); engine hold: the part of it generation is "
            "held, measured in vLLM's EngineCore"
        ),
        (
            "load: 1-min load average at the size's start-end (2 cores, shared: compare rows "
            "of one size only); ms"
        ),
    ]
    return pauses + "\n\n" + targets + "\n" + "\n".join(notes)


def combine(paths: Sequence[str]) -> str:
    ctxs = [json.loads(Path(p).read_text()) for p in paths]
    ctxs.sort(key=lambda c: c["world"]["params"])
    return render_sizes(ctxs)
