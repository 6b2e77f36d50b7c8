"""Weight updates in place: the pause rollpatch costs an engine, against a full reload.

Run: ``python bench/vllm.py`` (16M parameters, a few minutes on the 2-core development machine;
needs the vLLM venv from ``scripts/vllm-env``); ``--hidden 1024 --layers 8`` for a 103M model;
``--versions N``; ``--sizes 512x4,1024x8,2048x9`` runs several models (one process each) and
prints one table of all, ``--combine A.json ...`` prints it from kept runs (bench/_vllm_sizes.py);
``--json PATH`` keeps every sample (``pause_s`` of each under its path's
name: ``staged``, ``double``, ``inline``, ``catchup``, ``catchup_chain``, ``reloads``,
``reference``, ``reference_double``, ``reference_catchup``, ``reference_catchup_chain``,
``reference_catchup_followed``, ``reference_loads``).

**Model and versions.** A random BF16 Llama from :func:`make_tiny_model` (``--hidden``,
``--layers``; the size is printed). FP32 masters start as its weights (v0, the boot checkpoint);
each next version is one AdamW step (warm Adam state, ``--lr`` 5e-6), published as ``bf16`` by
a synchronous :class:`Publisher` to a ``file://`` board (keyframe at v0, step patches) and
written as a checkpoint directory — all before any timing. One vLLM 0.32 CPU server (TP 1, or
``--tp N`` ranks with the cores split between them; ``--enforce-eager``) with rollpatch's
worker extension; one built-in engine in this process.

Paths, each over the same versions:

- **staged** (what the follower does): ``Follower.sync(v)`` for v = 1..N with a
  :class:`CommitGate` in pause mode — fetch from the board, stage in the vLLM worker while it
  serves (decode, compose, prove the target digests in O(changed), lay the writes out per
  runtime parameter), then under the gate's pause: one scatter per parameter, repack of the
  touched modules, read-back, prefix-cache reset. *pause* = the gate's figure (its
  ``/pause?mode=keep`` to its ``/resume``); *visible→serving* = the whole ``sync`` (the patch
  is on the board when it starts; the engine serves it when it returns).
- **double** (double-buffered, ``VllmEngine(writes="double_buffer")``): the same syncs from
  v0, each touched parameter's new storage built while staging and exchanged under the pause;
  its greedy outputs must equal the in-place path's. Memory: VmHWM over this phase. Not at
  ``--tp`` > 1 (the double-buffered commit is TP 1's: its rows print "-").
- **inline** (the previous commit path, for comparison): ``VllmEngine.apply_encoded`` — the
  worker decodes and verifies *inside* the pause.
- **catchup**: back at v0 (untimed reload), one ``sync`` to v5 (``min(5, N)``): v0 is an anchor
  (``--fold-every`` 8, the default: the run publishes a folded patch from the last multiple of 8
  every version), so the plan is one folded patch v0 -> v5; **catchup_chain**: back at v1 (off
  the anchors), one ``sync`` to v6: the five step patches composed in the worker, one pause
  (``--fold-every 0``: the chain from v0 as before, no v1 row); **catchup_one**: back at v4,
  one ``sync`` to v5 (1 behind, the ratios' denominator, timed in the same turns). Five
  times each (``CATCHUP_REPS``), the rows in turn (the ratios: medians); each sample keeps
  its CPU time (``cpu_s``: this process and the vLLM worker, user + system), its plan's hops
  and the load.
- the **pause breakdown** (each sample's ``phases_ms`` in the JSON): the adapter's HTTP calls
  (``/pause``, the commit call, ``/update_weight_version``, ``/reset_prefix_cache``,
  ``/resume``; with the engine-core hook a staged commit is the commit call alone), the
  engine's hold measured in its core, and the worker's own parts (the writes with their
  read-back, slice by slice; the packed kernels' swap or repack).
- **reloads**: ``/pause?mode=keep``, ``collective_rpc reload_weights(checkpoint dir)`` (page
  cache warm), ``/update_weight_version``, ``/reset_prefix_cache``, ``/resume``.
- **fold_costs**: the run's versions published again per publisher configuration (step
  patches only, the default skip stride, ``fold_every=8``, both): CPU, encode time and bytes
  per version (bench/_vllm_fold.py).
- **catchup_plans** (the built-in engine's staging of the same lag v0 -> v5 along four plans:
  1 behind, the five steps, a skip patch + the last step, one folded patch; and a floor patch
  of 0.02% random changes; CPU time on one thread, with change records and bytes; then the
  decode by part and its fit to per-patch + per-record costs: bench/_vllm_catchup.py).
- **reference**, **reference_double**, **reference_catchup**, **reference_loads**: the same
  follower paths (in place, double-buffered, catch-up) on the built-in engine (staged in this process while it could serve; pause = the gate's), and its
  full ``load`` of each version's keyframe (copy + verify) under the same gate.
  ``reference_catchup_chain`` boots the engine at v1 (no records: the chain);
  **reference_catchup_followed** boots it at v0 and syncs to v1 untimed (the commit leaves its
  rewind record), then times the sync v1 -> v6: the records rebuild v0's words and the fold
  v0 -> v6 is decoded against them, one hop (docs/engines.md, *What reaches it*).
- **reference_floor**: the last in-place update written again as the commit writes it, as a
  plain numpy scatter (the floor of any in-place write) and one read pass of the model
  (bench/_vllm_floor.py).

**Memory**: VmHWM of the vLLM worker over the staged phase (reset before it) against the
largest staged update (positions, storage offsets, old and new words) it held; and the
worker's own trace of each staging run by phase (``stage_memory_mib`` of each sample: the
peak resident set above the run's start in decode, prove, layout, second buffers and packed
kernels; ``rollpatch.engines.vllm.memtrace``), printed as *worker memory while staging*.

**Checks** (the run aborts otherwise): every commit leaves the published digest (adapter and
follower); greedy tokens and logprobs after each staged commit equal those after the reload of
the same version (the writes reached the computation); the reloaded roots, re-hashed in the
workers, equal the published ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _util import log, machine
from _vllm_catchup import catchup_plans
from _vllm_fold import fold_costs
from _vllm_phases import (
    PROMPT,
    back_to,
    phase_catchups,
    phase_inline,
    phase_reloads,
    phase_staged,
    record_staging,
)
from _vllm_reference import (
    ANCHOR,
    CATCHUP,
    OFF_ANCHOR,
    ONE,
    phase_reference,
)
from _vllm_report import render
from _vllm_server import (
    BenchError,
    Server,
    _read,
    memory,
    reset_peak,
    vllm_python,
)
from _vllm_sizes import combine, parse_sizes, run_sizes, size_json
from _vllm_world import World, add_world_args, model_dims


def _run_sizes(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as err:
        ap.error(str(err))
    passed = ["--versions", str(args.versions), "--lr", str(args.lr), "--prepack", args.prepack]
    passed += ["--fold-every", str(args.fold_every), "--tp", str(args.tp)]
    with tempfile.TemporaryDirectory(prefix="rp-bench-vllm-sizes-") as tmp:
        out = [size_json(args.json, h, n, Path(tmp)) for h, n in sizes]
        run_sizes(Path(__file__), sizes, passed, out)
        print("\n" + combine([str(p) for p in out]))
    return 0


# -- report --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_world_args(ap, versions=8, hidden=512, layers=4)
    ap.add_argument(
        "--prepack",
        choices=("stage", "pause"),
        default="stage",
        help="CPU packed weights: built while staging (default) or in the pause",
    )
    ap.add_argument(
        "--fold-every",
        type=int,
        default=8,
        help="PublisherConfig.fold_every of the run (default 8: the catch-up from v0 is one "
        "folded patch, from v1 the chain; 0: step patches only)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="vLLM's tensor-parallel ranks (default 1; above 1 no double-buffered commits)",
    )
    ap.add_argument("--json", default=None, help="also write every measurement here")
    ap.add_argument(
        "--sizes",
        default=None,
        help="several models, HIDDENxLAYERS,... (e.g. 512x4,1024x8,2048x9): each run in its "
        "own process, then one table of all; --json PATH keeps each as PATH-hHlL.json",
    )
    ap.add_argument(
        "--combine", nargs="+", default=None, help="print the table of these runs' JSONs"
    )
    args = ap.parse_args(argv)
    if args.versions < 1 or args.tp < 1:
        ap.error("--versions and --tp must be >= 1")
    if args.combine:
        print(combine(args.combine))
        return 0
    if args.sizes:
        return _run_sizes(args, ap)
    python = vllm_python()
    mach = machine()
    load0 = mach["loadavg_1m"] or 0.0
    t_start = time.perf_counter()
    catch_n = min(CATCHUP, args.versions)
    from rollpatch.engines.vllm import VllmEngine

    with tempfile.TemporaryDirectory(prefix="rp-bench-vllm-") as tmp:
        root = Path(tmp)
        log(f"building the model and publishing v0..v{args.versions}")
        world = World(
            root, args.lr, args.versions, model_dims(args.hidden, args.layers), args.fold_every
        )
        log("built-in engine: staged commits, catch-up, keyframe loads")
        ref = phase_reference(world, catch_n)
        log(f"catch-up plans: staging v0 -> v{catch_n} by plan (CPU time, one thread)")
        plans = catchup_plans(world.checkpoint, world.digests, world.patch_blob, catch_n)
        log("publisher: what folded patches cost per version (CPU, encode, bytes)")
        folds = fold_costs(world.checkpoint, args.versions)
        log("starting vLLM on v0's checkpoint")
        server = Server(python, world.checkpoint(0), root / "vllm.log", tp=args.tp)
        engine = None
        try:
            start_s = server.wait_ready()
            engine = VllmEngine(server.url, prepack=args.prepack)
            engine.http.post(
                "/v1/completions",
                {"model": str(server.model), "prompt": "warm", "max_tokens": 2},
                timeout=600,
            )
            engine.adopt(0, world.digests[0])
            from transformers import AutoTokenizer

            prompt_ids = AutoTokenizer.from_pretrained(world.model)(PROMPT).input_ids
            pid = server.worker_pid()
            proc = f"pid {pid}, {_read(f'/proc/{pid}/comm')}"
            engine.apply_encoded(world.patch_blob(1), 1)  # warm-up (imports, arenas)
            back_to(world, engine)
            log("staged: Follower.sync per version (stage in the worker, write in the pause)")
            reset_peak(pid)
            mem0 = memory(pid)
            sizes: list[int] = []
            phases: list[dict[str, float]] = []
            mems: list[dict[str, float]] = []
            record_staging(engine, sizes, phases, mems)
            staged, served = phase_staged(
                world, engine, server, prompt_ids, sizes, phases, mems, pid
            )
            mem1 = memory(pid)
            double: list[dict[str, Any]] = []
            mem2 = mem3 = mem1
            if args.tp == 1:  # the double-buffered commit is TP 1's
                log("double-buffered: the same, each touched parameter's new buffer exchanged")
                back_to(world, engine)
                engine.writes = "double_buffer"
                reset_peak(pid)
                mem2 = memory(pid)
                double, served2 = phase_staged(
                    world, engine, server, prompt_ids, sizes, phases, mems, pid
                )
                mem3 = memory(pid)
                engine.writes = "in_place"
                if served2 != served:
                    raise BenchError("double-buffered commits answer differently from in-place")
            catchups = phase_catchups(world, engine, catch_n, sizes, phases, mems, pid)
            catchup = catchups[ANCHOR]
            del engine.stage_encoded
            log("inline: apply_encoded (decode inside the pause)")
            back_to(world, engine)
            inline = phase_inline(world, engine)
            log("reloads: reload_weights from checkpoint directories")
            reloads = phase_reloads(world, engine, server, prompt_ids, served)
        finally:
            if engine is not None:
                engine.close()
            server.stop()
        ctx = {
            "args": vars(args),
            "machine": mach,
            "start_s": start_s,
            "load": (load0, os.getloadavg()[0]),
            "wall_s": time.perf_counter() - t_start,
            "world": {
                "dims": world.dims,
                "changed": world.changed,
                "patch_bytes": world.patch_bytes,
                "ckpt_bytes": world.ckpt_bytes,
                "params": world.params,
            },
            "staged": staged,
            "double": double,
            "inline": inline,
            "catchup": catchup,
            "catchup_one": catchups[ONE],
            "catchup_chain": catchups.get(OFF_ANCHOR, []),
            "catchup_n": catch_n,
            "fold_every": args.fold_every,
            "catchup_plans": plans,
            "fold_costs": folds,
            "reloads": reloads,
            **ref,
            "memory": {
                "proc": proc,
                "start_kb": mem0["rss_kb"],
                "peak_kb": mem1["hwm_kb"] - mem0["rss_kb"],
                "after": mem1,
                "double_start_kb": mem2["rss_kb"],
                "double_peak_kb": mem3["hwm_kb"] - mem2["rss_kb"],
            },
        }
    print(render(ctx))
    if args.json:
        Path(args.json).write_text(json.dumps(ctx, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
