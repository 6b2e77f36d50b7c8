"""Board benchmark: publish latency, replica catch-up and peak memory, per store.

Run: ``python bench/board.py`` (1B parameters: 24 min and 21 GB peak system memory on the
2-core, 23.5 GiB development machine when it is quiet; over twice that under load, most of it
in the publisher's encode), ``python bench/board.py --params 5e7`` (quick, about 2 minutes),
or e.g. ``--stores file --versions 9 --lags 1,8 --json out.json``.

**Data.** One :mod:`rollpatch.sim` simulator (AdamW, Adam state warm at step 1000, seed 0,
``--lr`` 1e-6: ~1.2% of BF16 values change per step, the PULSE anchor) makes ``--versions``
consecutive versions; a :class:`~rollpatch.publisher.Publisher` (format ``bf16``,
``keyframe_every`` 1000 so that only v0 is a keyframe, ``skip_strides`` (4, 16)) publishes
them.

**Two phases, to fit in 24 GiB.** At 1B the simulator holds 11.3 GiB (FP32 w, m, v) and the
publisher needs another 8-12 GiB (its FP32 snapshot, two views, skip accumulators, the
keyframe blob), more than the machine has. So phase 1 runs the simulator alone and writes v0's
served view and, per step, the changed BF16 words (positions + words, ~10 B per changed value);
it also computes every version's view digest (``cast_view(masters).digest()``, independent of
the publisher) and writes the views replicas start from. Then the simulator is freed, and
phase 2 rebuilds, version by version, FP32 masters whose BF16 cast is exactly the
simulator's view (the BF16 words widened to FP32; kept in a file-backed map, as a trainer
keeps its weights on the GPU, not in host RAM) and publishes those: views, patches and
manifests are bit-identical to publishing the simulator's own masters (every manifest target
is checked against phase 1's digest), and the publisher does the same work (a 4 B/param FP32
snapshot, the FP32 → BF16 cast). Per version: rebuild, ``publish()``, ``flush()``;
nothing else runs meanwhile.

**Where.** ``file``: the whole run (``--versions``, default v0..v16) is published live to a
``file://`` store (fsync on) in a temporary directory. ``s3``: moto's standalone S3 server in
its own process on loopback (``tests/s3server.py``), started and stopped here; the first
``--s3-versions`` versions are published live to it a second time (v0 keyframe, then
patches: publish latency on S3), and catch-up on S3 reads a byte-identical mirror of the
whole file run (every object, manifest, marker and LATEST copied with the S3 store's
``put``).

**Catch-up.** A replica ``k`` versions behind the last version (``--lags``) is a
:class:`~rollpatch.engines.view_engine.ViewEngine` loaded (untimed) with the view of
``last - k`` that the publishing process wrote out, then timed catching up to ``last`` from
the measured store: ``chain`` (the k step patches, one ``Follower.sync`` and one commit each),
``folded`` (one ``sync`` with the board's fewest-bytes plan: skip patches, one commit) and
``keyframe`` (an empty engine booting: the keyframe, then the fewest-bytes patches).
``--composed-lags`` adds the step patches composed by the follower into one commit (its path
on a board without skip patches; its cost grows faster than linearly with k). Each replica
runs in its own subprocess (``bench/_board_follower.py``) so its peak RSS (VmHWM, reset after
the setup) is its own. Every replica's root digest is recomputed from its words, at the
start and at the end, and compared with phase 1's ``cast_view(masters).digest()`` of the
simulator's own masters, as is every manifest target. Any mismatch aborts the run. Staging
costs the same on both stores, so S3 by default measures only the one-hop paths
(``--s3-paths``: 1 behind, folded, keyframe), not the chains.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from _util import (
    current_rss,
    log,
    machine,
    machine_line,
    parse_size,
    peak_rss,
    reset_peak_rss,
    table,
)

from rollpatch.board import Board
from rollpatch.formats import cast_view
from rollpatch.io.safetensors import load_view, save_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.sim import AdamSim, SimConfig
from rollpatch.store import Store, open_store

HERE = Path(__file__).resolve().parent
RUN = "bench"
BUCKET = "rollpatch-bench"
FORMAT = "bf16"
GiB = 2**30


class BenchError(SystemExit):
    """A replica or a manifest is not what the publisher's view says it must be."""


# -- helpers ------------------------------------------------------------------------------------


def parse_count(text: str) -> int:
    """``1e9``, ``5e7``, ``1B``, ``50M``."""
    try:
        return int(float(text))
    except ValueError:
        return parse_size(text)


def fmt_bytes(n: float) -> str:
    for unit, mult in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= mult:
            return f"{n / mult:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def simulate(
    args: argparse.Namespace, n_params: int, work: Path, n: int, bases: dict[int, Path]
) -> tuple[dict[str, Any], dict[int, str]]:
    """Phase 1: run the simulator; write v0's view, the changed words of every step and the
    views of ``bases``; return simulator facts and every version's view digest.

    One view is kept and updated tensor by tensor, so phase 1 holds the simulator, one view
    and one tensor.
    """
    t0 = time.perf_counter()
    sim = AdamSim(SimConfig(n_params=n_params, lr=args.lr, seed=0))
    info: dict[str, Any] = {
        "n_params": sim.n_params,
        "dims": asdict(sim.dims),
        "init_s": time.perf_counter() - t0,
        "rss": current_rss(),
        "steps_s": [],
        "changed": [],
    }
    log(f"simulator: {sim.n_params:,} params, {gib(info['rss'])} RSS, {info['init_s']:.0f}s")
    digests: dict[int, str] = {}
    view = cast_view(sim.masters(), FORMAT)
    save_view(view, work / "v0.safetensors")
    info["view_bytes"] = view.nbytes
    names = sorted(view)
    for v in range(n):
        if v:
            t0 = time.perf_counter()
            sim.step()
            info["steps_s"].append(time.perf_counter() - t0)
            masters = sim.masters()
            arrays: dict[str, np.ndarray] = {}
            for i, name in enumerate(names):
                new = cast_view({name: masters[name]}, FORMAT)[name]
                pos = np.flatnonzero(view[name].data != new.data)
                arrays[f"p{i}"], arrays[f"w{i}"] = pos, new.data[pos]
                view[name] = new
            np.savez(work / f"d{v}.npz", **arrays)
            info["changed"].append(sum(a.size for k, a in arrays.items() if k[0] == "p"))
            log(
                f"sim v{v}: step {info['steps_s'][-1]:.1f}s, {info['changed'][-1]:,} values changed"
            )
        digests[v] = view.digest()
        if v in bases:
            save_view(view, bases[v])
    with open(work / "phase1.json", "w") as f:
        json.dump({"sim": info, "digests": digests}, f)
    return info, digests


class Replay:
    """FP32 masters whose BF16 cast is the simulator's version ``v`` (phase 2's input).

    They live in a file-backed map, as a trainer's weights live on its GPUs: the publisher
    copies them into host memory (its snapshot) and the kernel may page them out.
    """

    def __init__(self, work: Path) -> None:
        self.work = work
        view = load_view(work / "v0.safetensors", mmap=True)
        self.names = sorted(view)
        total = sum(view[n].n_elements for n in self.names)
        self._file = np.memmap(work / "masters.f32", dtype=np.float32, mode="w+", shape=(total,))
        self.masters: dict[str, np.ndarray] = {}
        start = 0
        for name in self.names:
            t = view[name]
            flat = self._file[start : start + t.n_elements]
            flat[:] = _widen(t.data)
            self.masters[name] = flat.reshape(t.shape)
            start += t.n_elements
        del view
        self.version = 0

    def advance(self) -> None:
        """Apply the next step's changed words."""
        self.version += 1
        with np.load(self.work / f"d{self.version}.npz") as d:
            for i, name in enumerate(self.names):
                self.masters[name].reshape(-1)[d[f"p{i}"]] = _widen(d[f"w{i}"])


def _widen(words: np.ndarray) -> np.ndarray:
    """BF16 words → the FP32 values they denote (exact)."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def child_peak_rss(needle: str) -> int | None:
    """VmHWM of this process's child whose command line contains ``needle`` (Linux)."""
    proc = Path("/proc")
    try:
        kids = [
            int(k)
            for t in (proc / str(os.getpid()) / "task").iterdir()
            for k in (t / "children").read_text().split()
        ]
        for k in kids:
            cmd = (proc / str(k) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if needle in cmd:
                for line in (proc / str(k) / "status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def s3_server() -> Iterator[Any]:
    """moto's standalone server on loopback (tests/s3server.py), with the bench bucket."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from s3server import moto_available, run_moto_server  # type: ignore[import-not-found]

    if not moto_available():
        raise SystemExit(
            "--stores s3 needs moto's standalone server: pip install "
            "'moto[server]' boto3 (or use --stores file)"
        )
    import boto3

    with run_moto_server() as server:
        boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            region_name=server.region,
            aws_access_key_id=server.access_key_id,
            aws_secret_access_key=server.secret_access_key,
        ).create_bucket(Bucket=BUCKET)
        yield server


# -- publishing ---------------------------------------------------------------------------------


def publish_run(
    replay: Replay, pub: Publisher, n: int, digests: dict[int, str], store: str
) -> tuple[list[dict[str, Any]], list[int]]:
    """Phase 2: publish versions 0..n-1 of ``replay``, each flushed before the next.

    Returns per-version records and the peak RSS of [the keyframe version, the others].
    Every manifest target must equal phase 1's view digest.
    """
    recs: list[dict[str, Any]] = []
    peaks: list[int] = []
    reset_peak_rss()
    for i in range(n):
        if i:
            replay.advance()
        t0 = time.perf_counter()
        v = pub.publish(replay.masters)
        ret = time.perf_counter() - t0
        pub.flush()
        flushed = time.perf_counter() - t0
        st = pub.stats.versions[-1]
        if st.version != v or v != replay.version:
            raise BenchError(
                f"{store}: published v{v}, stats v{st.version}, replay v{replay.version}"
            )
        if i == 0:
            peaks.append(peak_rss())
            reset_peak_rss()
        target = pub.board.manifest(RUN, v).target
        if target != digests[v]:
            raise BenchError(
                f"{store}: manifest v{v} target {target[:16]} != the simulator's "
                f"view digest {digests[v][:16]}"
            )
        recs.append({**asdict(st), "return_s": ret, "flush_s": flushed})
        log(
            f"{store} v{v}: return {ret:.2f}s, durable {st.total_s:.2f}s "
            f"(cast {st.cast_s:.1f} diff {st.diff_s:.1f} encode {st.encode_s:.1f} upload "
            f"{st.upload_s:.1f}), {fmt_bytes(st.bytes)}, {st.changed:,} changed"
        )
    peaks.append(peak_rss() if n > 1 else 0)
    return recs, peaks


def mirror(src: Store, dst: Store, run: str) -> tuple[int, int, float]:
    """Copy a run (objects, manifests, markers, then LATEST) byte for byte."""
    t0 = time.perf_counter()
    keys = src.list(f"runs/{run}/")
    order = sorted(keys, key=lambda k: (k.endswith("/LATEST"), "/versions/" in k, k))
    nbytes = 0
    for k in order:
        data = src.get(k)
        dst.put(k, data)
        nbytes += len(data)
    return len(keys), nbytes, time.perf_counter() - t0


# -- catch-up -----------------------------------------------------------------------------------


def catch_up(job: dict[str, Any]) -> dict[str, Any]:
    """One follower subprocess; raises BenchError with its stderr if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(HERE / "_board_follower.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise BenchError(
            f"follower subprocess failed ({job['path']}, have {job['have']}): "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr else ''}"
        )
    out = json.loads(proc.stdout)
    out["process_s"] = time.perf_counter() - t0
    return out


def catch_up_jobs(
    last: int, lags: Sequence[int], composed: Sequence[int]
) -> list[tuple[str, int | None, str]]:
    """(label, have, path) for every replica: chain, (composed,) folded per lag, a boot."""
    jobs: list[tuple[str, int | None, str]] = []
    for lag in lags:
        label = f"{lag} behind"
        if lag == 1:
            jobs.append((label, last - lag, "folded"))  # one hop: every path is the same
            continue
        jobs.append((label, last - lag, "chain"))
        if lag in composed:
            jobs.append((label, last - lag, "composed"))
        jobs.append((label, last - lag, "folded"))
    jobs.append(("boot", None, "keyframe"))
    return jobs


# -- report -------------------------------------------------------------------------------------


def publish_rows(
    store: str, recs: list[dict[str, Any]], peaks: list[int], base_rss: int
) -> list[list[str]]:
    rows = []
    kf, patch = recs[0], recs[1:]
    if patch:
        span = f"v{patch[0]['version']}..v{patch[-1]['version']} ({len(patch)})"
        ret = [r["call_return_s"] for r in patch]
        snap = [r["snapshot_s"] for r in patch]
        rows.append(
            [
                store,
                "publish() return",
                span,
                "-",
                "-",
                fmt_s(med(ret)),
                fmt_s(max(ret)),
                f"snapshot {fmt_s(med(snap))}",
                "-",
            ]
        )
        tot = [r["total_s"] for r in patch]
        objs = statistics.mean(1 + len(r["skip_bases"]) for r in patch)
        parts = " ".join(
            f"{k} {fmt_s(med([r[k + '_s'] for r in patch]))}"
            for k in ("cast", "diff", "encode", "upload", "commit")
        )
        rows.append(
            [
                store,
                "publish durable",
                span,
                f"{objs:.2f}",
                fmt_bytes(statistics.mean(r["bytes"] for r in patch)),
                fmt_s(med(tot)),
                fmt_s(max(tot)),
                parts,
                f"{gib(peaks[1])} (+{(peaks[1] - base_rss) / GiB:.1f})",
            ]
        )
    parts = " ".join(
        f"{k} {fmt_s(kf[k + '_s'])}" for k in ("call_return", "cast", "encode", "upload", "commit")
    )
    rows.append(
        [
            store,
            "publish durable",
            f"v{kf['version']} keyframe",
            "1",
            fmt_bytes(kf["bytes"]),
            fmt_s(kf["total_s"]),
            "-",
            parts.replace("call_return", "return"),
            f"{gib(peaks[0])} (+{(peaks[0] - base_rss) / GiB:.1f})",
        ]
    )
    return rows


def catch_up_rows(store: str, results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        path = {
            "chain": f"chain x{r['commits']}",
            "composed": "chain, 1 commit",
            "folded": "folded",
            "keyframe": "keyframe",
        }[r["path"]]
        if r["label"] == "1 behind":
            path = "step (=all)"
        rows.append(
            [
                store,
                f"catch-up {r['label']}",
                f"{path} {r['plan']}",
                str(r["objects"]),
                fmt_bytes(r["bytes"]),
                fmt_s(r["sync_s"]),
                "-",
                (
                    f"fetch {fmt_s(r['fetch_s'])} stage {fmt_s(r['stage_s'])} commit "
                    f"{fmt_s(r['commit_s'])}"
                ),
                gib(r["peak"]),
            ]
        )
    return rows


def render(rows: list[list[str]], ctx: dict[str, Any]) -> str:
    headers = [
        "store",
        "measure",
        "versions / plan",
        "objs",
        "bytes",
        "time s",
        "max s",
        "breakdown, s (median for publish rows)",
        "peak RSS",
    ]
    right = [False, False, False, True, True, True, True, False, True]
    a, sim, s3 = ctx["args"], ctx["sim"], ctx.get("s3")
    changed = 100 * med(sim["changed"]) / sim["n_params"] if sim["changed"] else 0.0
    foot = [
        "",
        (
            f"machine: {machine_line(ctx['machine'])}; load avg {ctx['load'][0]:.1f} at start, "
            f"{ctx['load'][1]:.1f} at end (shared machine: times are noisy, compare rows of this "
            f"run); {ctx['wall_s'] / 60:.1f} min wall"
        ),
        (
            f"sim: {sim['n_params']:,} params (hidden {sim['dims']['hidden']}, "
            f"{sim['dims']['layers']} layers), lr {a['lr']:g}, served {FORMAT} view "
            f"{fmt_bytes(sim['view_bytes'])}, {changed:.2f}% of its values change per step "
            f"(median); phase 1 (simulator alone, {gib(sim['rss'])} RSS): built in "
            f"{sim['init_s']:.0f}s, sim step {med(sim['steps_s']):.1f}s median, "
            f"{ctx['phase1_s']:.0f}s in all"
        ),
        (
            f"publisher: keyframe_every {a['keyframe_every']} (only v0 is a keyframe), "
            f"skip_strides {tuple(a['skip_strides'])}, max_pending 1; phase 2 (simulator freed): "
            "per version, rebuild FP32 masters whose bf16 cast is the simulator's view, "
            "publish(masters), flush() - nothing overlaps"
        ),
        (
            f"file: {a['versions']} versions v0..v{a['versions'] - 1} published live to file:// "
            "(fsync on, temp dir); catch-up reads them back (warm page cache)"
        ),
    ]
    if s3:
        foot += [
            (
                f"s3: moto standalone server process on loopback; publish rows: v0..v"
                f"{a['s3_versions'] - 1} of the same run published live again, to S3; catch-up "
                f"(paths {a['s3_paths']} and 1 behind) "
                f"reads a byte-identical mirror of the file run ({s3['mirror_keys']} keys, "
                f"{fmt_bytes(s3['mirror_bytes'])}, copied in {s3['mirror_s']:.0f}s); moto peak "
                f"RSS {gib(s3['moto_peak']) if s3['moto_peak'] else 'unknown'}"
            ),
        ]
    foot += [
        (
            "publish() return: wall time the caller is blocked (host snapshot of the masters + "
            "enqueue); publish durable: publish() call -> manifest written and LATEST advanced "
            "(PublisherStats.total_s)"
        ),
        (
            "  objs/bytes: objects and bytes uploaded per version (step patch + skip patches, "
            "mean); breakdown: cast, diff, encode (incl. composing and encoding skip patches), "
            "upload, commit (manifest + LATEST)"
        ),
        (
            "catch-up k behind: a replica holding last-k brought to last, one run each; chain xk "
            "= the k step patches, one Follower.sync and one commit each; chain, 1 commit = the "
            "step patches composed by the follower into one commit; folded = one sync with the "
            "board's fewest-bytes plan (skip patches), one commit; step (=all) = 1 behind, where "
            "every path is the same one patch; boot = empty engine: keyframe, then fewest-bytes "
            "patches"
        ),
        (
            "  objs/bytes: objects and bytes the follower fetched; time: wall of the sync(s) "
            "(plan, fetch, verify, stage, commit); breakdown: sums of Follower.status() "
            "timings"
        ),
        (
            "peak RSS: publish rows = VmHWM of the bench process while publishing the keyframe "
            f"/ the patch versions; (+x) = above its {gib(ctx['base_rss'])} before the first "
            "publish (interpreter, libraries, resident pages of the file-backed FP32 masters); catch-up "
            "rows = VmHWM of the follower subprocess during the sync (reset after its untimed "
            "setup, so the resident base view is included)"
        ),
        (
            f"verified: {ctx['n_checked']} replicas (start and end) and {ctx['n_manifests']} "
            "manifest targets bit-exact against cast_view(simulator masters).digest() from "
            "phase 1"
        ),
    ]
    return table(headers, rows, right) + "\n" + "\n".join(foot)


# -- main ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="1e9", help="simulator parameters (1e9, 5e7, 1B...)")
    ap.add_argument(
        "--versions", type=int, default=17, help="versions of the file run (v0 keyframe + patches)"
    )
    ap.add_argument(
        "--s3-versions",
        type=int,
        default=3,
        help="versions of the live S3 run (v0 keyframe + patches)",
    )
    ap.add_argument("--stores", default="file,s3", help="file, s3 or both")
    ap.add_argument("--lags", default="1,4,16", help="replica lags to catch up from")
    ap.add_argument(
        "--composed-lags",
        default="",
        help="lags also caught up over step patches in ONE commit (the follower "
        "composing them), e.g. 4",
    )
    ap.add_argument(
        "--s3-paths",
        default="folded,keyframe",
        help="catch-up paths also measured on S3 (chain, composed, folded, "
        "keyframe); staging costs the same on both stores, so by default "
        "S3 skips the slow chains",
    )
    ap.add_argument("--lr", type=float, default=1e-6, help="simulator learning rate")
    ap.add_argument("--skip-strides", default="4,16", help="PublisherConfig.skip_strides")
    ap.add_argument(
        "--keyframe-every",
        type=int,
        default=1000,
        help="PublisherConfig.keyframe_every (> versions: only v0 is a keyframe)",
    )
    ap.add_argument("--workdir", default=None, help="where the file board goes (temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the file board")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)

    n_params = parse_count(args.params)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    lags = sorted({int(x) for x in args.lags.split(",")})
    composed = sorted({int(x) for x in args.composed_lags.split(",") if x.strip()})
    s3_paths = {x.strip() for x in args.s3_paths.split(",") if x.strip()}
    strides = tuple(int(x) for x in args.skip_strides.split(","))
    last = args.versions - 1
    if not stores or set(stores) - {"file", "s3"}:
        ap.error("--stores takes file, s3 or file,s3")
    if not lags or lags[0] < 1 or lags[-1] > last:
        ap.error(f"--lags must lie in 1..{last} (--versions {args.versions})")
    if "s3" in stores and args.s3_versions < 1:
        ap.error("--s3-versions must be >= 1")
    args.skip_strides = strides
    mach = machine()
    load0 = mach["loadavg_1m"] or 0.0
    t_start = time.perf_counter()
    config = PublisherConfig(
        format=FORMAT, keyframe_every=args.keyframe_every, skip_strides=strides
    )
    ctx: dict[str, Any] = {"args": vars(args), "machine": mach}
    rows: list[list[str]] = []
    catch: dict[str, list[dict[str, Any]]] = {}
    pubs: dict[str, dict[str, Any]] = {}

    with contextlib.ExitStack() as stack:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="rollpatch-bench-board-"))
        work.mkdir(parents=True, exist_ok=True)
        if not args.keep:
            stack.callback(shutil.rmtree, work, ignore_errors=True)
        file_uri = (work / "board").resolve().as_uri()
        server = stack.enter_context(s3_server()) if "s3" in stores else None

        # -- phase 1: the simulator alone ---------------------------------------------------
        bases = {last - lag: work / f"base-v{last - lag}.safetensors" for lag in lags}
        t0 = time.perf_counter()
        ctx["sim"], digests = simulate(args, n_params, work, args.versions, bases)
        ctx["phase1_s"] = time.perf_counter() - t0
        gc.collect()

        # -- phase 2: publish the file run, then the first versions again to S3 -------------
        replay = Replay(work)
        base_rss = ctx["base_rss"] = current_rss()
        pub = Publisher(file_uri, RUN, config)
        recs, peaks = publish_run(replay, pub, args.versions, digests, "file")
        pub.close()
        del pub
        pubs["file"] = {"versions": recs, "peaks": peaks}
        if server is not None:
            del replay
            gc.collect()
            replay = Replay(work)
            s3_live = open_store(f"s3://{BUCKET}/live", **server.options())
            pub = Publisher(Board(s3_live), RUN, config)
            recs3, peaks3 = publish_run(replay, pub, args.s3_versions, digests, "s3")
            pub.close()
            del pub
            s3_live.close()
            pubs["s3"] = {"versions": recs3, "peaks": peaks3}
        n_manifests = sum(len(p["versions"]) for p in pubs.values())
        del replay
        gc.collect()

        # -- mirror the file run onto S3 ----------------------------------------------------
        targets: dict[str, tuple[str, dict[str, Any]]] = {"file": (file_uri, {})}
        if server is not None:
            src = open_store(file_uri)
            dst = open_store(f"s3://{BUCKET}/mirror", **server.options())
            keys, nbytes, mirror_s = mirror(src, dst, RUN)
            dst.close()
            log(f"mirrored {keys} keys, {fmt_bytes(nbytes)} to S3 in {mirror_s:.1f}s")
            ctx["s3"] = {"mirror_keys": keys, "mirror_bytes": nbytes, "mirror_s": mirror_s}
            targets["s3"] = (f"s3://{BUCKET}/mirror", server.options())

        # -- catch-up, one follower subprocess per replica --------------------------------------
        n_checked = 0
        for store in stores:
            uri, opts = targets[store]
            catch[store] = []
            for label, have, path in catch_up_jobs(last, lags, composed):
                if store == "s3" and path not in s3_paths and label != "1 behind":
                    continue
                job = {
                    "run": RUN,
                    "want": last,
                    "have": have,
                    "path": path,
                    "board": uri,
                    "board_options": opts,
                    "base_view": None if have is None else str(bases[have]),
                    "expected": {str(k): v for k, v in digests.items()},
                }
                r = catch_up(job)
                r["label"] = label
                n_checked += 1 + (have is not None)
                catch[store].append(r)
                log(
                    f"{store} {label} {path} {r['plan']}: {fmt_bytes(r['bytes'])} in "
                    f"{r['sync_s']:.2f}s (setup {r['setup_s']:.1f}s), peak {gib(r['peak'])}"
                )
        if server is not None:
            ctx["s3"]["moto_peak"] = child_peak_rss("moto.server")

    for store in stores:
        if store in pubs:
            p = pubs[store]
            rows += publish_rows(store, p["versions"], p["peaks"], base_rss)
    for store in stores:
        rows += catch_up_rows(store, catch[store])
    ctx["wall_s"] = time.perf_counter() - t_start
    ctx["load"] = (load0, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
    ctx["n_checked"] = n_checked
    ctx["n_manifests"] = n_manifests
    print(render(rows, ctx))
    if args.json:
        out = {**ctx, "publish": pubs, "catch_up": catch, "process_peak_rss": peak_rss()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
