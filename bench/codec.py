"""Codec benchmark: rollpatch patches against the i.i.d. entropy bound and the shipped baselines.

Run: ``python bench/codec.py`` (defaults below), or e.g.
``python bench/codec.py --sizes 20M --lrs 1e-6,1e-5 --formats bf16 --json out.json``.

**Data.** Consecutive FP32 master versions from :mod:`rollpatch.sim` (AdamW on synthetic
gradients, Adam state pre-warmed to step 1000; see that module for every modelling choice),
served through :func:`rollpatch.formats.cast_view` as BF16, FP8 E4M3 128×128 block and NVFP4
(``scales="bf16"``; embeddings, lm_head and norms stay BF16, as engines serve them). Each
(size, lr) starts a fresh simulator (seed 0) and measures ``steps`` consecutive transitions
for every format; one table row per (size, lr, format) aggregates them.

**What is compared** (all on the same transition, all in this process):

- *rollpatch*: ``diff`` + ``encode`` against the base view; ``decode`` + ``apply``
  (which verifies base and target digests).
- *XOR+zstd-3* (baseline 1, what Stitch and slime ship): per tensor, XOR of old and new
  view bytes, zstd level 3, plus a BLAKE3 of the new tensor as the checksum; decode+apply
  decompresses, XORs into the base in place and checks that checksum.
- *int32 index + words* (baseline 2): per tensor, int32 positions of changed words followed
  by the raw new words, zstd-3 over that; the uncompressed size (TRL-style) is in the JSON.
- *the i.i.d. bound*: ``n·H(k/n) + k·H(d)`` bits, ``n`` elements, ``k`` changed, ``d`` the
  integer delta new−old of each changed element in its word space (4-bit codes as nibbles),
  ``H`` the empirical entropy; over the whole view, and summed per tensor.

Both encoders hash the new view (rollpatch for its digests, XOR for its checksum) and both
run tensors on a pool of the same size (``min(4, cores)``, as ``rollpatch.patch.wire``).
Times are ``time.perf_counter`` wall clock, the best of ``--repeats`` where a view is under
1 GB, a single run above (decode+apply then goes straight into the base view, which becomes
the next transition's base). Every decode+apply of both codecs is checked bit-exact against
the target view; any mismatch aborts the run.

**Memory.** A simulator holds 12 B/param (FP32 w, m, v); the bench keeps one base view per
format (BF16 + FP8 + NVFP4 ≈ 3.9 B/param) and one target view at a time (≤ 2 B/param), and
applies patches in place, so 1B params peak at 19 GiB (measured; 100M: 2.5 GiB).

**Runtime** (measured on the 2-core development machine). A 1B simulator costs ~40 CPU-s to
build and ~14 CPU-s per step; casting it to the three formats ~17 s; one 1B transition of the
three formats 1.5-4.5 min (denser changes at lr 1e-5 cost the codec more). All three lrs at 1B
with two steps each would take ~20 min, so the default runs every lr at both sizes but only
one step at 1B (``--steps 2,1``): 13.0 min measured while other jobs held the load average
near 7, about 10 min on an idle machine. ``--steps 2`` gives two steps everywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3
import numpy as np
import zstandard
from _util import (
    best_of,
    log,
    machine,
    machine_line,
    parse_size,
    peak_rss,
    reset_peak_rss,
    table,
)

from rollpatch.analysis import iid_bound_bits, xor_zstd
from rollpatch.errors import PatchError
from rollpatch.formats import cast_view
from rollpatch.patch import Patch, apply, decode, diff, encode
from rollpatch.sim import AdamSim, SimConfig
from rollpatch.view import View

DEFAULT_FORMATS = "bf16,fp8-e4m3-block128,nvfp4"
ONE_RUN_ABOVE = 1 << 30     # views larger than this are timed once


class RoundTripError(SystemExit):
    """A decode+apply did not reproduce the target bit for bit."""


@dataclass
class Row:
    """Accumulated measurements of one (size, lr, format) over its transitions."""

    size: str
    n_params: int
    lr: float
    format: str
    transitions: int = 0
    view_bytes: int = 0
    elements: int = 0
    changed: int = 0
    patch_bytes: int = 0
    bound_bits: float = 0.0
    bound_tensor_bits: float = 0.0
    xor_bytes: int = 0
    idx_bytes: int = 0
    idx_raw_bytes: int = 0
    enc_s: float = 0.0
    dec_s: float = 0.0
    xor_enc_s: float = 0.0
    xor_dec_s: float = 0.0
    peak_rss: int = 0
    per_step: list[dict[str, Any]] = field(default_factory=list)


def _pool_size() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# -- the i.i.d. bound (shared with `rollpatch analyze`: rollpatch.analysis.bounds) ----------

def bound_bits(patch: Patch, view: View) -> tuple[int, int, float, float]:
    """(elements, changed, whole-view bound bits, per-tensor-sum bound bits)."""
    try:
        return iid_bound_bits(patch, view)
    except PatchError as e:
        raise RoundTripError(f"unexpected op in a same-layout diff: {e}") from None


# -- baselines --------------------------------------------------------------------------------

def _b3(data: np.ndarray) -> bytes:
    return blake3.blake3(data.view(np.uint8).data, max_threads=blake3.blake3.AUTO).digest()


def xor_encode(a: View, b: View, pool: ThreadPoolExecutor) -> dict[str, tuple[bytes, bytes]]:
    """Per tensor: (zstd-3 frame of old XOR new bytes, BLAKE3 of the new bytes)."""
    def one(name: str) -> tuple[bytes, bytes]:
        return xor_zstd(a[name].data, b[name].data), _b3(b[name].data)

    names = sorted(b)
    return dict(zip(names, pool.map(one, names)))


def xor_apply(view: View, frames: dict[str, tuple[bytes, bytes]], pool: ThreadPoolExecutor,
              verify: bool = True) -> None:
    """Decompress and XOR into ``view`` in place; check each checksum when ``verify``."""
    def one(name: str) -> None:
        frame, digest = frames[name]
        data = view[name].data
        x = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=data.dtype)
        np.bitwise_xor(data, x, out=data)
        if verify and _b3(data) != digest:
            raise RoundTripError(f"XOR+zstd checksum mismatch on {name}")

    for _ in pool.map(one, sorted(frames)):
        pass


def idx_sizes(a: View, b: View, pool: ThreadPoolExecutor) -> tuple[int, int]:
    """(raw, zstd-3) bytes of int32 changed-word positions followed by the new words."""
    def one(name: str) -> tuple[int, int]:
        old, new = a[name].data, b[name].data
        pos = np.flatnonzero(old != new).astype(np.int32)
        payload = pos.tobytes() + new[pos].tobytes()
        return len(payload), len(zstandard.ZstdCompressor(level=3).compress(payload))

    sizes = list(pool.map(one, sorted(b)))
    return sum(s[0] for s in sizes), sum(s[1] for s in sizes)


# -- one transition ---------------------------------------------------------------------------

def _check_equal(got: View, want: View, what: str) -> None:
    if sorted(got) != sorted(want) or any(
            not np.array_equal(got[n].data, want[n].data) for n in want):
        raise RoundTripError(f"{what}: decode+apply is not bit-exact")


def transition(a: View, b: View, row: Row, repeats: int, pool: ThreadPoolExecutor) -> None:
    """Measure a → b; on return ``a`` holds ``b``'s words (applied by the rollpatch codec)."""

    reps = 1 if a.nbytes > ONE_RUN_ABOVE else repeats
    a.digest()  # a publisher holds the base digests from the previous step

    def enc() -> tuple[Patch, bytes]:
        b.invalidate()
        p = diff(a, b)
        return p, encode(p, a)

    t_enc, (patch, blob) = best_of(enc, reps)
    n, k, whole, per = bound_bits(patch, a)
    del patch

    t_xenc, frames = best_of(lambda: xor_encode(a, b, pool), reps)
    t_xdec = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        xor_apply(a, frames, pool)
        t_xdec = min(t_xdec, time.perf_counter() - t0)
        _check_equal(a, b, "XOR+zstd-3")
        xor_apply(a, frames, pool, verify=False)   # XOR is its own inverse: back to the base
    xor_bytes = sum(len(f) for f, _ in frames.values())
    del frames
    idx_raw, idx_z = idx_sizes(a, b, pool)

    def dec_apply(view: View) -> View:
        return apply(view, decode(blob, view))

    t_dec = math.inf
    for _ in range(reps - 1):
        t, out = best_of(dec_apply, 1, setup=a.copy)
        _check_equal(out, b, "rollpatch")
        t_dec = min(t_dec, t)
        del out
    t, _ = best_of(lambda: dec_apply(a), 1)
    t_dec = min(t_dec, t)
    _check_equal(a, b, "rollpatch")
    if a.digest() != b.digest():
        raise RoundTripError("rollpatch: root digest differs after apply")

    row.transitions += 1
    row.view_bytes += a.nbytes
    row.elements += n
    row.changed += k
    row.patch_bytes += len(blob)
    row.bound_bits += whole
    row.bound_tensor_bits += per
    row.xor_bytes += xor_bytes
    row.idx_bytes += idx_z
    row.idx_raw_bytes += idx_raw
    row.enc_s += t_enc
    row.dec_s += t_dec
    row.xor_enc_s += t_xenc
    row.xor_dec_s += t_xdec
    row.per_step.append({"view_bytes": a.nbytes, "changed": k, "elements": n,
                         "patch_bytes": len(blob), "xor_bytes": xor_bytes, "idx_bytes": idx_z,
                         "enc_s": t_enc, "dec_s": t_dec, "xor_enc_s": t_xenc,
                         "xor_dec_s": t_xdec})


def run_group(size: str, n_params: int, lr: float, formats: Sequence[str], steps: int,
              repeats: int, pool: ThreadPoolExecutor) -> tuple[list[Row], dict[str, Any]]:
    """Fresh simulator at (size, lr); ``steps`` transitions for every format."""

    reset_peak_rss()
    t0 = time.perf_counter()
    sim = AdamSim(SimConfig(n_params=n_params, lr=lr, seed=0))
    info: dict[str, Any] = {"size": size, "lr": lr, "n_params": sim.n_params, "dims": asdict(sim.dims),
            "init_s": time.perf_counter() - t0, "step_s": [], "cast_s": {}}
    log(f"{size} lr={lr:g}: simulator {sim.n_params:,} params in {info['init_s']:.1f}s")
    rows = {f: Row(size, sim.n_params, lr, f) for f in formats}
    base = {}
    for f in formats:
        t0 = time.perf_counter()
        base[f] = cast_view(sim.masters(), f, scales="bf16")
        info["cast_s"][f] = time.perf_counter() - t0
    for s in range(steps):
        t0 = time.perf_counter()
        sim.step()
        info["step_s"].append(time.perf_counter() - t0)
        log(f"{size} lr={lr:g}: step {s + 1} in {info['step_s'][-1]:.1f}s")
        for f in formats:
            target = cast_view(sim.masters(), f, scales="bf16")
            transition(base[f], target, rows[f], repeats, pool)
            del target
            r = rows[f]
            log(f"  {f}: {100 * r.changed / r.elements:.3f}% changed, patch "
                f"{100 * r.patch_bytes / r.view_bytes:.3f}% of the view")
    peak = peak_rss()
    for r in rows.values():
        r.peak_rss = peak
    del sim, base
    return list(rows.values()), info


# -- report -----------------------------------------------------------------------------------

def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def render(rows: Sequence[Row], mach: dict, wall_s: float, load: tuple[float, float]) -> str:
    headers = ["size", "lr", "format", "view", "chg %", "patch %", "/bound", "/bnd-t",
               "xor x", "idx x", "enc GB/s (xor)", "dec+ap GB/s (xor)", "peak"]
    body = []
    for r in rows:
        enc, xenc = _rate(r.view_bytes, r.enc_s), _rate(r.view_bytes, r.xor_enc_s)
        dec, xdec = _rate(r.view_bytes, r.dec_s), _rate(r.view_bytes, r.xor_dec_s)
        body.append([
            r.size, f"{r.lr:.0e}", r.format, f"{r.view_bytes / r.transitions / 1e9:.2f} GB",
            f"{100 * r.changed / r.elements:.3f}", f"{100 * r.patch_bytes / r.view_bytes:.3f}",
            f"{8 * r.patch_bytes / r.bound_bits:.3f}" if r.bound_bits else "-",
            f"{8 * r.patch_bytes / r.bound_tensor_bits:.3f}" if r.bound_tensor_bits else "-",
            f"{r.xor_bytes / r.patch_bytes:.2f}", f"{r.idx_bytes / r.patch_bytes:.2f}",
            f"{enc:.2f} ({enc / xenc:.2f}x)", f"{dec:.2f} ({dec / xdec:.2f}x)",
            f"{r.peak_rss / 2**30:.1f} GiB",
        ])
    right = [False, True, False] + [True] * 10
    n_steps = sorted({r.transitions for r in rows})
    foot = [
        "",
        (f"machine: {machine_line(mach)}; load avg {load[0]:.1f} at start, {load[1]:.1f} at "
         f"end; {wall_s / 60:.1f} min wall"),
        (f"each row: {'/'.join(map(str, n_steps))} consecutive AdamW steps of rollpatch.sim "
         "(Adam state warm at step 1000), views cast with scales=bf16"),
        "chg %    changed elements / all elements of the served view (4-bit codes count one each)",
        "patch %  encoded rollpatch patch bytes / view bytes",
        ("/bound   patch bits / i.i.d. bound n*H(k/n) + k*H(d) over the whole view (d = new-old "
         "word as integer,"),
        ("         nibbles for 4-bit kinds; H empirical); < 1 means the codec's context model "
         "beats position-blind coding"),
        "/bnd-t   the same against the bound summed per tensor (own k/n and delta histogram)",
        ("xor x    XOR+zstd-3 bytes / patch bytes (baseline 1: per-tensor XOR of old and new "
         "bytes, zstd level 3)"),
        ("idx x    int32-positions+new-words, zstd-3, bytes / patch bytes (baseline 2; raw "
         "size in the JSON)"),
        (f"GB/s     view bytes / best wall time on a {_pool_size()}-thread pool; enc = diff + "
         "hash new view + encode,"),
        ("         dec+ap = decode + apply with digest checks; (xor) = rollpatch speed / "
         "XOR+zstd-3 speed, same run"),
        ("peak     peak RSS of the (size, lr) group: simulator FP32 w,m,v (12 B/param) + "
         "views; every round trip"),
        "         of both codecs verified bit-exact",
    ]
    return table(headers, body, right) + "\n" + "\n".join(foot)


def _steps_for(text: str, n_sizes: int) -> list[int]:
    steps = [int(s) for s in text.split(",")]
    if len(steps) == 1:
        steps *= n_sizes
    if len(steps) != n_sizes or any(s < 1 for s in steps):
        raise SystemExit("--steps: one positive int, or one per size")
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100M,1B", help="parameter counts, e.g. 20M,100M,1B")
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="AdamW learning rates")
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help="served formats")
    ap.add_argument("--steps", default="2,1",
                    help="transitions per (size, lr): one int, or one per size")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats for views < 1 GB")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    lrs = [float(x) for x in args.lrs.split(",")]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    steps = _steps_for(args.steps, len(sizes))
    mach = machine()
    load0 = mach["loadavg_1m"] or 0.0
    t_start = time.perf_counter()
    rows: list[Row] = []
    sims: list[dict[str, Any]] = []
    with ThreadPoolExecutor(_pool_size()) as pool:
        for size, n_steps in zip(sizes, steps):
            for lr in lrs:
                got, info = run_group(size, parse_size(size), lr, formats, n_steps,
                                      args.repeats, pool)
                rows += got
                sims.append(info)
    wall = time.perf_counter() - t_start
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    print(render(rows, mach, wall, (load0, load1)))
    if args.json:
        out = {"args": vars(args), "machine": mach, "wall_s": wall, "loadavg_end": load1,
               "simulators": sims, "rows": [asdict(r) for r in rows],
               "process_peak_rss": peak_rss()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
