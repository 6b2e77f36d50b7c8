"""SGLang weight updates in place: the pause rollpatch costs SGLang, against SGLang's own reload.

Run: ``python bench/sglang.py`` (16M parameters; needs the SGLang venv from
``scripts/sglang-env``); ``--hidden 1024 --layers 8`` for a 103M model; ``--versions N``;
``--tp 2`` for SGLang at ``--tp-size 2`` (one core per rank; each touched tensor decoded
inside SGLang by the rank that owns it, after the ranks copied their blocks of it into
shared memory: *gather*);
``--json PATH`` keeps every sample (``pause_s`` of each under its path's name: ``staged``,
``double``, ``reloads``).

**Model and versions**: bench/vllm.py's (``_vllm_world.World``): a random BF16 Llama, FP32
masters under warm AdamW (``--lr`` 5e-6), each version published as ``bf16`` to a ``file://``
board and written as a checkpoint directory, all before any timing. One SGLang 0.5.23 CPU
server (TP 1, ``torch_native`` attention, the ``sgl_kernel`` import shim: the run aborts if it
was ever called) with rollpatch's custom weight loader.

Paths, each over the same versions (v1..vN, from v0):

- **staged** (rollpatch): the version's wire-format patch object as published;
  ``stage_encoded`` while SGLang serves (decode against the live words, validate, prove the
  target digests), then ``pause`` … ``commit_staged`` … ``resume``. *pause* = from the
  pause request to the answer of ``/continue_generation`` (SGLang's ``retract`` pause, begin/
  update/end of the weight-update session with the scatter and read-back, prefix-cache flush,
  ``/update_weight_version``); *visible→serving* = from the stage call to
  ``/continue_generation`` answered. The *pause breakdown* splits the pause by route.
- **double** (rollpatch, ``writes="double_buffer"``): the same, but staging also builds each
  touched parameter's second buffer inside SGLang (a copy, the staged words written, checked
  and read back), and the commit under the pause only exchanges storages (O(1) per
  parameter); the replaced storage is freed after the pause.
- **reloads** (SGLang's own): the same pause, then ``/update_weights_from_disk`` of the
  version's checkpoint directory (read once before: page cache warm), then
  ``/continue_generation``.

**Bytes moved** per version: rollpatch's patch object (what crosses the wire and the
processes) against the checkpoint a reload reads. **Checks** (the run aborts otherwise): each
commit leaves the published digest; greedy tokens and logprobs after each staged commit equal
those after SGLang's reload of the same version, and those after each double-buffered commit
equal the in-place ones; after each reload the live words, re-hashed in SGLang, are the
published version's.

**Stage breakdown** (medians, ms): *gather* (TP > 1: the touched tensors' blocks copied by
every rank into shared memory for their owners), *decode* (the patch object decoded against
the live words: the codec's own pass; inside SGLang, by the owner ranks at TP > 1),
*prove* (validation, old words, O(changed) digests), *layout* (runtime offsets merged per
parameter), *buffers* (double-buffered copies written and read back), *transfer* (the rest of
the adapter's call: the patch written to a file, the control socket, the answer).

**Catch-up** (``CHAIN_REPS`` times each way, rotated, each from a fresh load of v0):
1 behind and ``--versions`` behind, ``stage_encoded`` (decoded inside SGLang) of the step
patches' chain and (``--fold-every``, default 8: v0 is the anchor) of the one folded patch
v0 → vN the run published, which is what the follower's plan takes from an anchor (a
keyframe boot, a replica that stopped at a multiple of 8), against what the follower does
when SGLang does not take a plan: each step decoded in the bench's process against the
words exported from SGLang tensor by tensor (gathered from every rank at TP > 1),
composed, staged as one decoded patch.

**Pause breakdown** (medians, ms): the pause by route (``pause_parts``): SGLang's pause and
continue, its weight-update session (opened once and left open: 0 under a commit's pause),
rollpatch's command inside SGLang (the writes and their read-back, or the exchange), the
rest of the update route (SGLang's IPC, the prefix-cache flush), the version tag, and what
remains (the adapter's checks).
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

from _sglang_chain import phase_chain, view_of
from _sglang_report import pause_parts, render
from _sglang_server import Server, reload_paused
from _util import log, machine
from _vllm_server import BenchError
from _vllm_world import World, add_world_args, model_dims

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12]
CHAIN_REPS = 3  # catch-ups of --versions steps each way, each from a fresh load of v0


def greedy(engine: Any) -> tuple[list[int], list[float]]:
    r = engine._http(
        "POST",
        "/generate",
        {
            "input_ids": PROMPT_IDS,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
    )
    return list(r["output_ids"]), [float(x[0]) for x in r["meta_info"]["output_token_logprobs"]]


def phase_staged(
    world: World, engine: Any, n: int, expect: list[Any] | None = None
) -> tuple[list[dict[str, float]], list[Any]]:
    """Each version staged then committed; ``expect``: the outputs each commit must give."""
    from rollpatch.engines.staged import EncodedStep

    runs, served = [], []
    for v in range(1, n + 1):
        blob = world.patch_blob(v)
        t0 = time.perf_counter()
        staged = engine.stage_encoded(
            [EncodedStep((blob,), world.digests[v - 1], world.digests[v])], v
        )
        if staged is None:
            raise BenchError(f"v{v}: SGLang did not take the patch (stage_encoded gave None)")
        t1 = time.perf_counter()
        engine.channel.route_ms.clear()
        engine.pause()
        try:
            engine.commit_staged(staged, v)
        finally:
            engine.resume()
        t2 = time.perf_counter()
        routes = dict(engine.channel.route_ms)
        held = engine.channel.held_s
        serving = engine.channel._frozen_at + held  # /continue_generation answered
        if engine.digest != world.digests[v] or engine.held()[1] != world.digests[v]:
            raise BenchError(f"v{v}: the engine does not hold the published digest")
        inside = {"gather": 0.0, **engine.last_stage_ms}
        runs.append(
            {
                **{f"{k}_ms": float(x) for k, x in inside.items()},
                "stage_s": t1 - t0,
                "transfer_ms": (t1 - t0) * 1e3 - inside["inside"] + inside.get("read", 0.0),
                "pause_s": held,
                "commit_s": t2 - t1,
                "visible_s": serving - t0,
                "bytes": len(blob),
                "changed": staged.changed,
                "staged_bytes": staged.nbytes,
                **pause_parts(routes, engine.last_timings["command_s"] * 1e3, held),
            }
        )
        served.append(greedy(engine))
        if expect is not None and served[-1] != expect[v - 1]:
            raise BenchError(f"v{v}: {engine.writes} commits serve otherwise than in place")
    if expect is not None and engine.held(fresh=True)[1] != world.digests[n]:
        raise BenchError(f"v{n}: the live words, re-hashed, are not the published ones")
    return runs, served


def phase_reloads(world: World, engine: Any, n: int, served: list[Any]) -> list[dict[str, float]]:
    runs = []
    for v in range(1, n + 1):
        ckpt = world.warm(v)  # page cache warm before the clock starts
        t0 = time.perf_counter()
        engine.channel.route_ms.clear()
        reload_paused(engine, ckpt, f"reload-{v}")
        t1 = time.perf_counter()
        if greedy(engine) != served[v - 1]:
            raise BenchError(f"v{v}: outputs after the patch differ from the reload's")
        if engine.held(fresh=True)[1] != world.digests[v]:
            raise BenchError(f"v{v}: SGLang's reload does not hold the published digest")
        routes = dict(engine.channel.route_ms)
        runs.append(
            {
                "pause_s": t1 - t0,
                "bytes": world.ckpt_bytes[v],
                **pause_parts(routes, routes.get("/update_weights_from_disk", 0.0), t1 - t0),
            }
        )
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_world_args(ap, versions=5, hidden=512, layers=4)
    ap.add_argument("--tp", type=int, default=1, help="SGLang's --tp-size (default 1)")
    ap.add_argument(
        "--fold-every",
        type=int,
        default=8,
        help="PublisherConfig.fold_every of the run (default 8: the catch-up from v0 is also "
        "timed as the one folded patch the follower's plan takes; 0: step patches only)",
    )
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    if args.versions < 1:
        ap.error("--versions must be >= 1")
    if args.fold_every < 0:
        ap.error("--fold-every must be >= 0")
    from rollpatch.engines.sglang import SglangEngine

    mach, load0, t_start = machine(), os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rp-bench-sglang-") as tmp:
        root = Path(tmp)
        log(f"building the model and publishing v0..v{args.versions}")
        world = World(
            root, args.lr, args.versions, model_dims(args.hidden, args.layers), args.fold_every
        )
        log("starting SGLang on v0's checkpoint")
        server = Server(world.checkpoint(0), root / "sglang.log", tp=args.tp)
        engine = None
        try:
            start_s = server.wait_ready()
            engine = SglangEngine(server.url)
            engine.adopt(0, world.digests[0])
            greedy(engine)  # warm-up
            log("staged: stage_encoded while serving, commit_staged under the pause")
            staged, served = phase_staged(world, engine, args.versions)
            log("double: second buffers built while serving, exchanged under the pause")
            engine.load(view_of(world, 0), 0)
            engine.close()
            engine = SglangEngine(server.url, writes="double_buffer")
            engine.adopt(0, world.digests[0])
            double, _ = phase_staged(world, engine, args.versions, expect=served)
            log("reloads: SGLang's update_weights_from_disk of each version")
            engine.load(view_of(world, 0), 0)
            reloads = phase_reloads(world, engine, args.versions, served)
            chain: dict[str, list[dict[str, float]]] = {}
            engine.close()
            engine = SglangEngine(server.url)
            engine.adopt(args.versions, world.digests[args.versions])
            for n in sorted({1, args.versions}):
                log(f"catch-up: {n} behind from v0, decoded inside SGLang and by the follower")
                got = phase_chain(world, engine, n, CHAIN_REPS)
                chain.update({f"{k}{n}": runs for k, runs in got.items()})
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
                "fold_every": world.fold_every,
                "changed": world.changed,
                "params": world.params,
                "patch_bytes": world.patch_bytes,
                "ckpt_bytes": world.ckpt_bytes,
            },
            "staged": staged,
            "double": double,
            "reloads": reloads,
            "chain": chain,
        }
    if args.json:  # first: a table that fails to render loses no measurement
        Path(args.json).write_text(json.dumps(ctx, indent=1, default=str))
    print(render(ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
