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
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _board_data import FORMAT, Replay, gib, simulate
from _board_report import catch_up_rows, fmt_bytes, publish_rows, render
from _board_stores import BUCKET, child_peak_rss, mirror, s3_server
from _util import (
    current_rss,
    log,
    machine,
    parse_size,
    peak_rss,
    reset_peak_rss,
)

from rollpatch.board import Board
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import open_store

HERE = Path(__file__).resolve().parent
RUN = "bench"


class BenchError(SystemExit):
    """A replica or a manifest is not what the publisher's view says it must be."""


# -- helpers ------------------------------------------------------------------------------------


def parse_count(text: str) -> int:
    """``1e9``, ``5e7``, ``1B``, ``50M``."""
    try:
        return int(float(text))
    except ValueError:
        return parse_size(text)


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
