"""vLLM weight updates: rollpatch's in-place patch vs vLLM's full reload from a checkpoint.

Run: ``python bench/vllm.py`` (about 1.5 minutes on the 2-core development machine; needs
the vLLM venv from ``scripts/vllm-env``; ``--hidden 1024 --layers 8``, a 103M-parameter model,
about 2 minutes), ``--versions N``, ``--json out.json`` for every sample.

**Model.** A random BF16 Llama from :func:`make_tiny_model`: by default hidden 512, 4 layers,
8 heads / 4 kv heads, ff 1408, vocab 4096, 16.0M parameters, a 32 MB checkpoint (``--hidden``,
``--layers`` scale it; the size is printed), served by one vLLM 0.32 CPU server
(``--dtype bfloat16 --enforce-eager --max-model-len 512``) with rollpatch's worker extension
and its weight-transfer backend, bound to 127.0.0.1.

**Versions.** FP32 masters start as the model's weights (v0, the server's boot checkpoint).
Each next version is one AdamW step (warm Adam state, gradients ``s_t(0.15 P + e)``, as in
``bench/sidecar.py``; ``--lr`` 5e-6), published as ``bf16`` by a synchronous
:class:`Publisher` to a ``file://`` board (keyframe at v0 only, step patches), and written as
a checkpoint directory (config, tokenizer, ``model.safetensors``) — all before any timing.

**A. In-place patches** (v0 → v1 → … → vN): the step patch object as published (fetched from
the board, hash-checked) handed to :meth:`VllmEngine.apply_encoded`: ``/pause?mode=keep``,
the official weight-update routes (decoded, written, repacked and verified in the worker),
``/finish_weight_update``, ``/reset_prefix_cache``, ``/resume``. *pause* = the whole call
(the engine is paused from its first HTTP call to its last); *apply* = the worker's own time
for the operation.

**C. Decoded patches** (back to v0 by an untimed reload, then v0 → … → vN again): the
adapter-side path — decode here against ``engine.words()`` (the worker exports every touched
tensor through the shared directory) while vLLM keeps serving (*staging*), then
:meth:`VllmEngine.apply` ships the decoded patch (*pause* = that call; *apply* = the worker's
time). This is what a follower does for multi-step plans, and through the sidecar's commit
gate.

**B. Full reloads** (v1 … vN again, same server): ``/pause?mode=keep``, ``POST
/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (vLLM 0.32's
in-place reload: ``Worker.reload_weights`` → ``model_loader.reload.reload_weights``, reading
the whole checkpoint, layerwise re-processing, CPU weights re-packed), ``/update_weight_version``,
``/reset_prefix_cache``, ``/resume``. *pause* = the same bracket; *apply* = the
``collective_rpc`` call (HTTP round trip included; the checkpoint is in the page cache).

**Bytes moved** per version: the patch object vs the checkpoint file the reload reads.
**Memory**: VmRSS / VmHWM of the vLLM worker process (``VLLM::Worker``, a child of the
EngineCore on vLLM 0.32 CPU; it holds the weights), read from ``/proc``; the peak is reset
(``clear_refs`` 5) before each phase, so each phase's peak is its own. The adapter side (this
process) is reported too: the decoded path copies touched tensors into it.

**Warm-up** (untimed): one request, one encoded patch v0 → v1 and a reload back to v0.

**Checks** (the run aborts otherwise): after every patch the adapter's verified digest equals
the published version's; after every reload the workers' re-hashed root digest equals it too,
and the greedy tokens and logprobs of a fixed prompt equal those served after the patch to
the same version (the reload re-packed what it loaded; the patch reached the computation).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _util import (
    WarmAdamW,
    current_rss,
    log,
    machine,
    machine_line,
    peak_rss,
    reset_peak_rss,
    table,
)

from rollpatch.board import Board
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig

RUN = "bench"
VLLM_VERSION = "0.32.0"
VOCAB = 4096


def model_dims(hidden: int, layers: int) -> dict[str, int]:
    """Llama-shaped: 64-wide heads, half as many KV heads, ff ≈ 2.75 x hidden (multiple of 64)."""
    heads = max(1, hidden // 64)
    return {"hidden_size": hidden, "layers": layers, "heads": heads,
            "kv_heads": max(1, heads // 2), "intermediate": 64 * round(2.75 * hidden / 64),
            "vocab_size": VOCAB}
PROMPT = "What is 12 + 7? The answer is"
MAX_TOKENS = 8


class BenchError(SystemExit):
    """A commit, a reload or the server is not what it must be."""


# -- the vLLM server -----------------------------------------------------------------------------

def vllm_python() -> Path:
    """The python of the venv ``scripts/vllm-env`` builds (same lookup as the tests)."""
    env = os.environ.get("ROLLPATCH_VLLM_VENV")
    venv = Path(env) if env else Path.home() / ".cache" / "rollpatch" / f"vllm-venv-{VLLM_VERSION}"
    python, stamp = venv / "bin" / "python", venv / ".stamp-vllm"
    if not python.exists() or not stamp.exists() or VLLM_VERSION not in stamp.read_text():
        raise BenchError(f"no vLLM venv at {venv}: build it with scripts/vllm-env")
    return python


class Server:
    """One vLLM OpenAI server with rollpatch's extension, in its own process group."""

    def __init__(self, python: Path, model: Path, log_path: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        repo = Path(__file__).resolve().parents[1]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="auto",
                   HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=str(repo / "src"), VLLM_LOGGING_LEVEL="WARNING")
        env.pop("VIRTUAL_ENV", None)
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
               "--max-model-len", "512", "--enforce-eager", "--seed", "0",
               "--worker-extension-cls", "rollpatch.engines.vllm.WorkerExtension",
               "--weight-transfer-config", '{"backend": "rollpatch"}']
        self.log_path = log_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        self.model = model

    def wait_ready(self, timeout: float = 400.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise BenchError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise BenchError(f"vLLM not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def worker_pid(self) -> int:
        """The process holding the weights: vLLM 0.32 on CPU runs its worker in a child of
        the EngineCore (``VLLM::Worker``); else the EngineCore (a uniprocess executor), else
        the largest descendant."""
        kids = _descendants(self.proc.pid)
        for name in ("VLLM::Worker", "VLLM::EngineCor"):
            for pid in kids:
                if _read(f"/proc/{pid}/comm").startswith(name):
                    return pid
        if not kids:
            raise BenchError("the vLLM server has no child process")
        return max(kids, key=lambda p: status_kb(p, "VmRSS"))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                parent[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def status_kb(pid: int, field: str) -> int:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise BenchError(f"no {field} for pid {pid}")


def reset_peak(pid: int) -> bool:
    """VmHWM := VmRSS (Linux ``clear_refs`` 5); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def greedy(http: Any, model: Path, prompt_ids: list[int]) -> tuple[list[str], list[float]]:
    r = http.post("/v1/completions", {
        "model": str(model), "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = r["choices"][0]["logprobs"]
    return list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]]


# -- the run: a model, its masters under AdamW, a board, checkpoints -----------------------------

class World:
    """The model, FP32 masters with warm AdamW state, the board, one checkpoint per version."""

    def __init__(self, root: Path, lr: float, versions: int, dims: dict[str, int]) -> None:
        from transformers.utils import logging as hf_logging

        from rollpatch.engines.reference import make_tiny_model
        from rollpatch.io.safetensors import load_view

        hf_logging.disable_progress_bar()
        self.root = root
        self.dims = dims
        self.model = make_tiny_model(root / "model", seed=0, **dims)
        self.masters = {n: t.to_array().astype(np.float32)
                        for n, t in load_view(self.model / "model.safetensors").items()}
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(self.board, RUN, PublisherConfig(keyframe_every=0,
                                                                    skip_strides=()),
                                   asynchronous=False)
        self.adam = WarmAdamW(self.masters, lr)
        self.digests: list[str] = []
        self.changed: list[float] = [0.0]
        self.patch_bytes: list[int] = [0]
        self.ckpt_bytes: list[int] = []
        self.view = cast_view(self.masters, "bf16")
        self.params = sum(t.n_elements for t in self.view.values())
        self._publish()
        for _ in range(versions):
            self.step()

    def step(self) -> None:
        """One AdamW step of every master, then publish it."""
        self.adam.step()
        before, self.view = self.view, cast_view(self.masters, "bf16")
        changed = sum(int(np.count_nonzero(before[k].data != t.data))
                      for k, t in self.view.items())
        self.changed.append(changed / self.params)
        self._publish()

    def _publish(self) -> None:
        from rollpatch.io.safetensors import save_view

        v = self.publisher.publish(self.masters)
        if v != len(self.digests):
            raise BenchError(f"published v{v}, expected v{len(self.digests)}")
        self.digests.append(self.view.digest())
        m = Board(self.board).manifest(RUN, v)
        if m.target != self.digests[v]:
            raise BenchError(f"manifest target of v{v} is not cast_view(masters).digest()")
        if v:
            self.patch_bytes.append(sum(p.ref.size for p in m.patches_from(v - 1)))
        ckpt = self.checkpoint(v)
        ckpt.mkdir()
        for p in self.model.iterdir():
            if p.suffix != ".safetensors":
                shutil.copy(p, ckpt / p.name)
        save_view(self.view, ckpt / "model.safetensors")
        self.ckpt_bytes.append((ckpt / "model.safetensors").stat().st_size)

    def checkpoint(self, v: int) -> Path:
        return self.root / f"ckpt-{v:04d}"

    def patch_blob(self, v: int) -> bytes:
        board = Board(self.board)
        (po,) = board.manifest(RUN, v).patches_from(v - 1)
        return board.fetch(po.ref)


# -- the two phases ------------------------------------------------------------------------------

def phase_patches(world: World, server: Server, engine: Any, prompt_ids: list[int]
                  ) -> tuple[list[dict[str, float]], dict[int, Any]]:
    out, served = [], {}
    for v in range(1, len(world.digests)):
        blob = world.patch_blob(v)
        t0 = time.perf_counter()
        engine.apply_encoded(blob, v)
        pause = time.perf_counter() - t0
        if (engine.version, engine.digest) != (v, world.digests[v]):
            raise BenchError(f"v{v}: the engine does not hold the published digest")
        out.append({"pause_s": pause, "apply_s": engine.last_timings["worker_ms"] / 1e3})
        served[v] = greedy(engine.http, server.model, prompt_ids)
        log(f"  patch  v{v}: pause {pause * 1e3:.0f} ms")
    return out, served


def phase_decoded(world: World, server: Server, engine: Any, prompt_ids: list[int],
                  served: dict[int, Any]) -> list[dict[str, float]]:
    """The EngineAdapter path: decode here against ``engine.words()`` (each touched tensor
    exported by the worker), then :meth:`VllmEngine.apply` ships the decoded patch."""
    from rollpatch.patch import decode

    out = []
    for v in range(1, len(world.digests)):
        blob = world.patch_blob(v)
        t0 = time.perf_counter()
        patch = decode(blob, engine.words(), check_base=False)  # the engine checks the base
        t1 = time.perf_counter()
        engine.apply(patch, v)
        t2 = time.perf_counter()
        del patch
        if (engine.version, engine.digest) != (v, world.digests[v]):
            raise BenchError(f"v{v}: the engine does not hold the published digest")
        if greedy(engine.http, server.model, prompt_ids) != served[v]:
            raise BenchError(f"v{v}: the decoded path answers differently from the encoded")
        out.append({"stage_s": t1 - t0, "pause_s": t2 - t1,
                    "apply_s": engine.last_timings["worker_ms"] / 1e3})
        log(f"  decoded v{v}: staging {(t1 - t0) * 1e3:.0f} ms, pause {(t2 - t1) * 1e3:.0f} ms")
    return out


def reload(http: Any, path: Path) -> None:
    http.post("/collective_rpc", {"method": "reload_weights",
                                  "kwargs": {"weights_path": str(path)}, "timeout": 600})


def phase_reloads(world: World, server: Server, engine: Any, prompt_ids: list[int],
                  served: dict[int, Any]) -> list[dict[str, float]]:
    http, out = engine.http, []
    for v in range(1, len(world.digests)):
        t0 = time.perf_counter()
        http.post("/pause?mode=keep")
        t1 = time.perf_counter()
        reload(http, world.checkpoint(v))
        t2 = time.perf_counter()
        http.post("/update_weight_version", {"new_version": str(v)})
        http.post("/reset_prefix_cache")
        http.post("/resume")
        pause = time.perf_counter() - t0
        root = engine.held(fresh=True)[1]  # untimed: the workers re-hash every tensor
        if root != world.digests[v]:
            raise BenchError(f"v{v}: after reload_weights the engine holds other bits")
        if greedy(http, server.model, prompt_ids) != served[v]:
            raise BenchError(f"v{v}: the reloaded engine answers differently from the patched")
        out.append({"pause_s": pause, "apply_s": t2 - t1})
        log(f"  reload v{v}: pause {pause * 1e3:.0f} ms")
    return out


def memory(pid: int) -> dict[str, int]:
    return {k: status_kb(pid, f) for k, f in (("rss_kb", "VmRSS"), ("hwm_kb", "VmHWM"),
                                              ("anon_kb", "RssAnon"), ("file_kb", "RssFile"))}


# -- report --------------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


def _mb(kb: int) -> str:
    return f"{kb / 1024:.0f} MiB"


def _sign(kb: int) -> str:
    return ("+" if kb >= 0 else "-") + _mb(abs(kb))


def render(ctx: dict[str, Any]) -> str:
    headers = ["version", "changed", "patch", "checkpoint", "patch/ckpt", "patch pause",
               "patch apply", "decoded staging", "decoded pause", "reload pause",
               "reload apply", "reload/patch pause"]
    w, pa, de, re_ = ctx["world"], ctx["patches"], ctx["decoded"], ctx["reloads"]
    n = len(pa)

    def cells(changed: float, pb: float, cb: float, p: dict[str, float], d: dict[str, float],
              r: dict[str, float], ratio: float) -> list[str]:
        return [f"{100 * changed:.2f}%", f"{pb / 1e3:.0f} kB", f"{cb / 1e6:.1f} MB",
                f"{pb / cb:.4f}", _ms(p["pause_s"]), _ms(p["apply_s"]), _ms(d["stage_s"]),
                _ms(d["pause_s"]), _ms(r["pause_s"]), _ms(r["apply_s"]), f"{ratio:.2f}x"]

    rows = [[f"v{i - 1}->v{i}", *cells(w["changed"][i], w["patch_bytes"][i], w["ckpt_bytes"][i],
                                       pa[i - 1], de[i - 1], re_[i - 1],
                                       re_[i - 1]["pause_s"] / pa[i - 1]["pause_s"])]
            for i in range(1, n + 1)]

    def med(xs: Sequence[float]) -> float:
        return statistics.median(xs)

    def med_of(runs: list[dict[str, float]]) -> dict[str, float]:
        return {k: med([r[k] for r in runs]) for k in runs[0]}

    rows.append(["median", *cells(med(w["changed"][1:]), med(w["patch_bytes"][1:]),
                                  med(w["ckpt_bytes"][1:]), med_of(pa), med_of(de), med_of(re_),
                                  med([r["pause_s"] / p["pause_s"] for p, r in zip(pa, re_)]))])
    right = [False] + [True] * (len(headers) - 1)
    m, d = ctx["memory"], ctx["world"]["dims"]
    peak_note = "" if m["resettable"] else " (VmHWM not resettable here: peaks since boot)"
    kib = 1024
    foot = [
        "",
        (f"machine: {machine_line(ctx['machine'])}; load avg {ctx['load'][0]:.1f} at start, "
         f"{ctx['load'][1]:.1f} at end (shared machine: compare rows of this run only); "
         f"{ctx['wall_s'] / 60:.1f} min wall, vLLM start {ctx['start_s']:.0f} s"),
        (f"model: make_tiny_model hidden {d['hidden_size']}, {d['layers']} layers, "
         f"{d['heads']}/{d['kv_heads']} heads, ff {d['intermediate']}, vocab {d['vocab_size']}"
         f" = {w['params'] / 1e6:.1f}M params, {w['ckpt_bytes'][0] / 1e6:.1f} MB bf16 checkpoint; "
         f"vLLM {VLLM_VERSION} CPU, TP 1, --enforce-eager; times in ms"),
        (f"versions: AdamW lr {ctx['args']['lr']:g} (warm state) published by Publisher to a "
         "file:// board; one server, the same versions on every path, in the order patch "
         "v0..vN, decoded v0..vN, reload v1..vN"),
        ("patch      VllmEngine.apply_encoded(the published step patch), what the follower "
         "now does for a single step: pause = the whole call (/pause?mode=keep .. /resume,"),
        ("           official weight-update routes); apply = the worker's time (decode against "
         "its own weights, write, repack, verify) — the decode is inside the pause"),
        ("decoded    the EngineAdapter path: staging = decode here against words() (every "
         "touched tensor exported by the worker; the engine keeps serving), then"),
        ("           VllmEngine.apply(decoded patch): pause = that call, the worker writes, "
         "repacks, verifies"),
        ("reload     /pause?mode=keep, collective_rpc reload_weights(weights_path=checkpoint "
         "dir, page cache warm), /update_weight_version, /reset_prefix_cache, /resume;"),
        ("           apply = the rpc call; nothing is verified by vLLM (checked here after, "
         "untimed); reload/patch pause < 1: the reload paused vLLM for less"),
        ("bytes      patch = the step patch object as published; checkpoint = the "
         "model.safetensors the reload reads"),
        (f"memory     vLLM worker ({m['proc']}: holds the weights and the 1 GiB KV cache) "
         f"RSS {_mb(m['boot']['rss_kb'])} after a request (boot peak {_mb(m['boot']['hwm_kb'])}"
         "), then one untimed patch + reload (warm-up)."
         " Per phase: peak over the RSS at its start / RSS kept after it (anon + file-backed):"),
        "           " + "; ".join(
            f"{name} +{_mb(m[key]['hwm_kb'] - m[key]['start_kb'])} / "
            f"{_sign(m[key]['rss_kb'] - m[key]['start_kb'])} (anon {_mb(m[key]['anon_kb'])}, "
            f"file {_mb(m[key]['file_kb'])})"
            for name, key in (("patches", "patches"), ("decoded", "decoded"),
                              ("reloads", "reloads"))) + peak_note,
        ("           this (adapter) process, peak over its RSS at the phase start: patches +"
         f"{_mb((m['patches']['here_peak'] - m['patches']['here_start']) // kib)}, decoded +"
         f"{_mb((m['decoded']['here_peak'] - m['decoded']['here_start']) // kib)} (words() "
         "copies of the touched tensors, the decoded patch)"),
        (f"verified:  {n} x 2 committed digests = published; {n} reloaded roots (re-hashed in "
         f"the workers) = published; greedy tokens+logprobs after each decoded commit and "
         f"reload = after the patch"),
    ]
    return table(headers, rows, right) + "\n" + "\n".join(foot)


# -- main ----------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=8, help="versions after v0 (default 8)")
    ap.add_argument("--lr", type=float, default=5e-6, help="AdamW learning rate")
    ap.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    ap.add_argument("--layers", type=int, default=4, help="model depth (default 4)")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    if args.versions < 1:
        ap.error("--versions must be >= 1")
    python = vllm_python()
    mach = machine()
    load0 = mach["loadavg_1m"] or 0.0
    t_start = time.perf_counter()
    from rollpatch.engines.vllm import VllmEngine

    with tempfile.TemporaryDirectory(prefix="rp-bench-vllm-") as tmp:
        root = Path(tmp)
        log(f"building the model and publishing v0..v{args.versions}")
        world = World(root, args.lr, args.versions, model_dims(args.hidden, args.layers))
        log("starting vLLM on v0's checkpoint")
        server = Server(python, world.checkpoint(0), root / "vllm.log")
        engine = None
        try:
            start_s = server.wait_ready()
            engine = VllmEngine(server.url)
            engine.http.post("/v1/completions", {"model": str(server.model), "prompt": "warm",
                                                 "max_tokens": 2}, timeout=600)
            engine.adopt(0, world.digests[0])
            from transformers import AutoTokenizer

            prompt_ids = AutoTokenizer.from_pretrained(world.model)(PROMPT).input_ids
            greedy(engine.http, server.model, prompt_ids)
            pid = server.worker_pid()
            proc = f"pid {pid}, {_read(f'/proc/{pid}/comm')}"
            mem: dict[str, dict[str, int]] = {"boot": memory(pid)}
            resettable = True

            def phase(name: str, fn: Any, *a: Any) -> Any:
                """Run one phase between two memory readings, peaks reset before it."""
                nonlocal resettable
                resettable = reset_peak(pid) and resettable
                reset_peak_rss()
                start, here0 = memory(pid), current_rss()
                out = fn(world, server, engine, prompt_ids, *a)
                mem[name] = {"start_kb": start["rss_kb"], **memory(pid),
                             "here_start": here0, "here_peak": peak_rss()}
                return out

            engine.apply_encoded(world.patch_blob(1), 1)  # warm-up: the worker's decode path
            reload(engine.http, world.checkpoint(0))     # (imports, arenas), then back to v0
            engine.adopt(0, world.digests[0])
            log("A: encoded patches (decoded in the worker)")
            patches, served = phase("patches", phase_patches)
            log("C: decoded patches (decoded here against words())")
            reload(engine.http, world.checkpoint(0))  # untimed: back to v0
            engine.adopt(0, world.digests[0])
            decoded = phase("decoded", phase_decoded, served)
            log("B: full reloads from checkpoint directories")
            reloads = phase("reloads", phase_reloads, served)
        finally:
            if engine is not None:
                engine.close()
            server.stop()
        ctx = {
            "args": vars(args), "machine": mach, "start_s": start_s,
            "load": (load0, os.getloadavg()[0]), "wall_s": time.perf_counter() - t_start,
            "world": {"dims": world.dims, "changed": world.changed,
                      "patch_bytes": world.patch_bytes,
                      "ckpt_bytes": world.ckpt_bytes, "params": world.params},
            "patches": patches, "decoded": decoded, "reloads": reloads,
            "memory": {**mem, "resettable": resettable, "proc": proc},
        }
    print(render(ctx))
    if args.json:
        Path(args.json).write_text(json.dumps(ctx, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
