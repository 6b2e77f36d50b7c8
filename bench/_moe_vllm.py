"""``bench/moe.py --vllm``: expert patches in a live vLLM (CPU MoE kernel), against a reload.

A tiny Qwen3-MoE from :func:`make_tiny_moe_model` (``--hidden``, ``--layers``, ``--experts``,
``--moe-intermediate``; the size is printed). FP32 masters start as its weights (v0, the boot
checkpoint); each next version is a sign step (``--lr``, an early Adam step's size) of the
attention, norms, routers and of each expert with probability ``--hot`` (cold experts get no
gradient), cast to BF16 and written as a checkpoint directory, all before any timing. One
vLLM 0.32 CPU server (TP 1, ``--enforce-eager``, the engine-core hook) with rollpatch's worker
extension, whose CPU MoE kernel prepacks the experts.

Paths, each over the same versions v0 → vN:

- **staged** (``prepack="stage"``, the follower's default): each step staged in the worker
  while vLLM serves (decode, prove, lay out; the touched experts' packed slices built with
  vLLM's ``cpu_prepack_moe_weight``), then one engine-core commit that copies those slices in
  (read back) and writes nothing else: the plain words of kernel-only layers are written after
  it. *pause* = the commit call's wall time; *hold* = the engine core's own figure.
- **pause-repack** (``prepack="pause"``): the plain words written under the pause and every
  touched layer re-packed whole there.
- **keyframe**: ``VllmEngine.load`` of each version (every word written, every layer
  re-packed, the root re-hashed).
- **reload**: ``/pause?mode=keep``, ``collective_rpc reload_weights(checkpoint dir)`` (page
  cache warm), ``/update_weight_version``, ``/reset_prefix_cache``, ``/resume``.

**Checks** (the run aborts otherwise): after every staged commit the workers' full re-hash of
the plain words equals the published digest and the live packed experts equal vLLM's prepack
of them (``rollpatch_packed``); the pause-repack and keyframe paths serve the staged path's
greedy tokens and logprobs bit for bit. The reload's outputs are compared with them too and
the table says whether they match (not a check: see the printed note).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _util import log, machine, machine_line, table
from _vllm_server import BenchError, Server, greedy, vllm_python

PROMPT_IDS = [5, 17, 301, 44, 1000, 7, 99, 123, 8, 640, 12, 3]


def _versions(v0: Any, n: int, lr: float, hot: float, seed: int) -> tuple[list[Any], list[int]]:
    from rollpatch.formats import cast_view

    masters = {k: t.to_array().astype(np.float32) for k, t in v0.items()}
    rng = np.random.default_rng(seed)
    out, touched = [v0], []
    for _ in range(n):
        moves: dict[str, bool] = {}
        for name, m in masters.items():
            if ".experts." in name:
                expert = name.rsplit(".", 2)[0]  # model.layers.L.mlp.experts.E
                if moves.setdefault(expert, bool(rng.random() < hot)) is False:
                    continue
            m -= lr * np.sign(rng.standard_normal(m.shape)).astype(np.float32)
        out.append(cast_view(masters, "bf16"))
        touched.append(sum(moves.values()))
    return out, touched


def _rpc(http: Any, method: str) -> dict[str, Any]:
    res = http.post("/collective_rpc", {"method": method, "args": [], "timeout": 600})
    out = res["results"][0]
    if not out.get("ok"):
        raise BenchError(f"{method}: {out}")
    return dict(out)


def run(args: argparse.Namespace) -> str:
    from rollpatch.engines.reference import make_tiny_moe_model
    from rollpatch.engines.staged import EncodedStep
    from rollpatch.engines.vllm import VllmEngine
    from rollpatch.io.safetensors import load_view, save_view
    from rollpatch.patch import diff, encode

    tmp = Path(tempfile.mkdtemp(prefix="moe-vllm-", dir=args.tmp))
    mach = machine()
    t_start = time.perf_counter()
    try:
        v0_dir = make_tiny_moe_model(
            tmp / "v0",
            hidden_size=args.hidden,
            layers=args.layers,
            experts=args.experts,
            top_k=args.top_k,
            moe_intermediate=args.moe_intermediate,
            heads=max(4, args.hidden // 128),
            kv_heads=2,
        )
        v0 = load_view(v0_dir / "model.safetensors")
        versions, hot = _versions(v0, args.versions, args.lr, args.hot, 0)
        dirs = [v0_dir]
        for k in range(1, len(versions)):
            dirs.append(tmp / f"v{k}")
            shutil.copytree(v0_dir, dirs[-1])
            save_view(versions[k], dirs[-1] / "model.safetensors", {"format": "pt"})
        steps = [
            EncodedStep((encode(diff(a, b), a),), a.digest(), b.digest())
            for a, b in itertools.pairwise(versions)
        ]
        n_params = sum(t.n_elements for t in v0.values())
        n_expert = sum(t.n_elements for n, t in v0.items() if ".experts." in n)
        changed = [diff(a, b).n_changed / n_params for a, b in itertools.pairwise(versions)]
        log(f"model {n_params:,} params ({n_expert / n_params:.0%} experts), {len(steps)} steps")
        server = Server(vllm_python(), v0_dir, tmp / "vllm.log")
        try:
            log(f"vLLM ready in {server.wait_ready():.0f} s")
            rows = _measure(server, versions, steps, dirs, VllmEngine)
        finally:
            server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _render(rows, mach, t_start, args, n_params, n_expert, changed, hot)


def _measure(
    server: Server, versions: list[Any], steps: list[Any], dirs: list[Path], engine_cls: Any
) -> dict[str, Any]:
    eng = engine_cls(server.url)
    http = eng.http
    try:
        greedy(http, server.model, PROMPT_IDS)  # the first request compiles
        eng.adopt(0, versions[0].digest())
        if _rpc(http, "rollpatch_packed")["mismatched"]:
            raise BenchError("the booted packed experts differ from prepack(plain)")
        served, staged, hold, install = {}, [], [], []
        for k, step in enumerate(steps, start=1):
            st = eng.stage_encoded([step], k)
            t0 = time.perf_counter()
            eng.commit_staged(st, k)
            staged.append(time.perf_counter() - t0)
            hold.append(eng.last_timings.get("core_ms", float("nan")) / 1e3)
            install.append(eng.last_timings.get("derived_ms", float("nan")) / 1e3)
            if eng.held(fresh=True)[1] != versions[k].digest():
                raise BenchError(f"v{k}: the plain words do not hash to the published digest")
            if _rpc(http, "rollpatch_packed")["mismatched"]:
                raise BenchError(f"v{k}: live packed experts differ from prepack(plain)")
            served[k] = greedy(http, server.model, PROMPT_IDS)
        out: dict[str, Any] = {"staged": staged, "hold": hold, "install": install}
        eng.load(versions[0], 0)
        slow = engine_cls(server.url, prepack="pause")
        try:
            slow.adopt(0, versions[0].digest())
            out["pause-repack"] = []
            for k, step in enumerate(steps, start=1):
                st = slow.stage_encoded([step], k)
                t0 = time.perf_counter()
                slow.commit_staged(st, k)
                out["pause-repack"].append(time.perf_counter() - t0)
                if greedy(http, server.model, PROMPT_IDS) != served[k]:
                    raise BenchError(f"v{k}: prepack='pause' serves other outputs than staged")
        finally:
            slow.close()
        out["keyframe"] = []
        for k in range(1, len(versions)):
            t0 = time.perf_counter()
            eng.load(versions[k], k)
            out["keyframe"].append(time.perf_counter() - t0)
            if greedy(http, server.model, PROMPT_IDS) != served[k]:
                raise BenchError(f"v{k}: a keyframe load serves other outputs than staged")
        out["reload"], out["reload_same"] = [], 0
        for k in range(1, len(versions)):
            t0 = time.perf_counter()
            http.post("/pause?mode=keep")
            http.post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(dirs[k])}},
            )
            http.post("/update_weight_version", {"new_version": str(k)})
            http.post("/reset_prefix_cache")
            http.post("/resume")
            out["reload"].append(time.perf_counter() - t0)
            out["reload_same"] += greedy(http, server.model, PROMPT_IDS) == served[k]
        return out
    finally:
        eng.close()


def _ms(xs: Sequence[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms"


def _render(
    rows: dict[str, Any],
    mach: dict[str, Any],
    t_start: float,
    args: argparse.Namespace,
    n_params: int,
    n_expert: int,
    changed: list[float],
    hot: list[int],
) -> str:
    base = statistics.median(rows["reload"])
    n = len(rows["staged"])
    lines = [
        (
            f"== vLLM CPU MoE: {n_params / 1e6:.1f}M params ({n_expert / n_params:.0%} in experts), "
            f"{args.layers} layers x {args.experts} experts (top {args.top_k}), {n} commits =="
        ),
        "",
    ]

    def row(label: str, key: str, serves: str) -> list[str]:
        return [label, _ms(rows[key]), f"{statistics.median(rows[key]) / base:.1%}", serves]

    body = [
        row("staged (prepack=stage)", "staged", "yes"),
        row("  engine-core hold", "hold", ""),
        row("  packed slices copied in", "install", ""),
        row("pause-repack (prepack=pause)", "pause-repack", "yes"),
        row("keyframe load (in place)", "keyframe", "yes"),
        ["vLLM reload_weights", _ms(rows["reload"]), "100%", f"{rows['reload_same']}/{n}"],
    ]
    lines.append(
        table(
            ["path", "pause p50", "vs reload", "serves the staged outputs"],
            body,
            [False, True, True, True],
        )
    )
    lines += [
        "",
        (
            f"changed values per step: {', '.join(f'{c:.2%}' for c in changed)}; experts moved per "
            f"step (of {args.layers * args.experts}): {', '.join(map(str, hot))}; lr {args.lr:g}"
        ),
        f"machine: {machine_line(mach)}; {(time.perf_counter() - t_start) / 60:.1f} min wall",
    ]
    if rows["reload_same"] < n:
        lines.append(
            "note: after reload_weights vLLM served other outputs than the verified versions "
            "(vLLM 0.32's CPU MoE kernel is not re-packed by a weight reload: the reloaded "
            "checkpoint words land unpacked in the packed parameters)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="expert patches in a live vLLM (CPU MoE kernel)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 32)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (all sparse)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token")
    ap.add_argument("--moe-intermediate", type=int, default=256, help="expert width (x32)")
    ap.add_argument("--versions", type=int, default=4, help="commits to time")
    ap.add_argument("--lr", type=float, default=5e-6, help="sign-step size")
    ap.add_argument("--hot", type=float, default=0.5, help="chance an expert moves per step")
    ap.add_argument("--tmp", default=None, help="scratch directory (checkpoints, log)")
    args = ap.parse_args(argv)
    if args.versions < 1:
        raise SystemExit("--versions must be >= 1")
    print(run(args))
    return 0
