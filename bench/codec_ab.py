"""In-process A/B of builds of the native core: decode+apply (and, with ``--encode``, encode)
of the same transition, builds alternated, XOR+zstd-1 in the same rotation as the yardstick.

Run: ``python bench/codec_ab.py OLD.so NEW.so`` (copies of ``_rpcore*.so``: build, copy it
away, change the C, build again), e.g.
``python bench/codec_ab.py /tmp/old.so src/rollpatch/native/_rpcore*.so --lrs 1e-6,1e-5``.

Why: on a shared machine, two bench/codec.py runs minutes apart differ by more than most
changes to the core (single rows swing by 0.2-0.8 in rp/xor1 between runs of the same
build). Here every build decodes the same patch of the same views in one process, in a
rotated order each repeat (old, new, xor; new, xor, old; ...), so a load spike hits all of
them alike; the table gives medians and minimums of wall and process CPU time, and the
load average over the run. Every build is loaded as its own module object (its own static
state and thread pool); ``rollpatch.native.core`` is switched between them.

Checks: every build's encode gives the same bytes as the first build's (the wire format
does not depend on the build), and every decode+apply is checked against the target's root
digest; any difference aborts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

from _baselines import RoundTripError, restore, xor_apply, xor_encode
from _util import log, parse_size

from rollpatch import native
from rollpatch.errors import BaseMismatchError, PatchDecodeError
from rollpatch.formats import cast_view
from rollpatch.patch import apply_encoded, encode_views
from rollpatch.sim import AdamSim, SimConfig
from rollpatch.view import View


def load_core(path: str) -> ModuleType:
    """The core built at ``path``, as a module object of its own."""
    spec = importlib.util.spec_from_file_location("rollpatch.native._rpcore", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.set_errors(PatchDecodeError, BaseMismatchError)
    if mod.CHUNK != native.CHUNK:
        raise SystemExit(f"{path}: built for another chunk size")
    return mod


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def measure(
    a: View, b: View, cores: dict[str, ModuleType], threads: int, reps: int, encode: bool
) -> dict[str, dict[str, list[float]]]:
    """{method: {"wall"|"cpu": [ms per repeat]}} for decode+apply (``"<build>"``), encode
    (``"<build> enc"``) and XOR+zstd-1 (``"xor1"``, ``"xor1 enc"``)."""
    os.environ["ROLLPATCH_THREADS"] = str(threads)
    names = list(cores)
    native.core = cores[names[0]]
    blob = encode_views(a, b)
    for n in names[1:]:
        native.core = cores[n]
        if encode_views(a, b) != blob:
            raise RoundTripError(f"build {n} encodes other bytes than {names[0]}")
    target = b.digest()
    work = a.copy()
    out: dict[str, dict[str, list[float]]] = {}

    def add(key: str, wc: tuple[float, float]) -> None:
        d = out.setdefault(key, {"wall": [], "cpu": []})
        d["wall"].append(wc[0])
        d["cpu"].append(wc[1])

    with ThreadPoolExecutor(threads) as pool:
        frames = xor_encode(a, b, pool, 1)
        order = [*names, "xor1"]
        for r in range(reps):
            for m in order[r % len(order) :] + order[: r % len(order)]:
                restore(work, a)
                if m == "xor1":
                    add(m, _timed(lambda: xor_apply(work, frames, pool)))
                    if encode:
                        add("xor1 enc", _timed(lambda: xor_encode(a, b, pool, 1)))
                    continue
                native.core = cores[m]
                add(m, _timed(lambda: apply_encoded(work, blob)))
                if work.digest() != target:
                    raise RoundTripError(f"build {m}: root digest differs after apply")
                if encode:
                    b.invalidate()
                    add(f"{m} enc", _timed(lambda: encode_views(a, b)))
    return out


def report(title: str, out: dict[str, dict[str, list[float]]], first: str) -> str:
    """One block of the table: each method's medians and minimums, and its ratios."""
    lines = [title]
    for key, d in out.items():
        w, c = d["wall"], d["cpu"]
        ref = out["xor1 enc" if key.endswith(" enc") else "xor1"]["wall"]
        base = out.get(f"{first} enc" if key.endswith(" enc") else first, d)["wall"]
        lines.append(
            f"  {key:14s} wall med {statistics.median(w):7.1f} min {min(w):7.1f}"
            f"  cpu med {statistics.median(c):7.1f} min {min(c):7.1f}"
            f"  /xor1 med {statistics.median(w) / statistics.median(ref):.2f}"
            f"  /{first} med {statistics.median(w) / statistics.median(base):.3f}"
            f" min {min(w) / min(base):.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("builds", nargs="+", help="the core's .so files (the first: the reference)")
    ap.add_argument("--size", default="100M", help="parameter count, e.g. 20M, 100M")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="AdamW learning rates")
    ap.add_argument("--formats", default="bf16", help="served formats")
    ap.add_argument("--threads", default="1,2", help="thread counts")
    ap.add_argument("--reps", type=int, default=11, help="repeats of each method")
    ap.add_argument("--encode", action="store_true", help="time encode too")
    ap.add_argument("--vocab", type=int, default=None, help="the simulator's vocabulary")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    names = [Path(p).name.split(".")[0] for p in args.builds]
    names = [f"{i}:{n}" for i, n in enumerate(names)]  # distinct even for equal file names
    cores = {n: load_core(p) for n, p in zip(names, args.builds, strict=True)}
    saved = native.core
    try:
        for lr in (float(x) for x in args.lrs.split(",")):
            extra = {} if args.vocab is None else {"vocab": args.vocab}
            sim = AdamSim(SimConfig(n_params=parse_size(args.size), lr=lr, seed=0, **extra))
            a0 = sim.masters()
            views = {f: cast_view(a0, f, scales="bf16") for f in args.formats.split(",")}
            sim.step()
            for f, a in views.items():
                b = cast_view(sim.masters(), f, scales="bf16")
                a.digest()  # a publisher holds the base digests from the previous step
                for t in (int(x) for x in args.threads.split(",")):
                    log(f"{args.size} lr={lr:g} {f} T={t}")
                    l0 = os.getloadavg()[0]
                    out = measure(a, b, cores, t, args.reps, args.encode)
                    l1 = os.getloadavg()[0]
                    title = f"{args.size} lr={lr:g} {f} T={t} reps={args.reps} load {l0:.2f} -> {l1:.2f}"
                    print(report(title, out, names[0]), flush=True)
    finally:
        native.core = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
