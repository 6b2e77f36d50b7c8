"""A copy with a staged update written in: the native one-pass ``copy_with_writes`` against
the three steps it replaced (a fresh copy, a checked scatter, a read-back).

What it stands for: before a commit, each touched parameter of a double-buffered engine gets
a second buffer, and in vLLM on the CPU each touched module's prebuilt kernel is packed from
such a copy (docs/engines.md, *What a commit costs*). Per shape (the 441M model of
``bench/vllm.py --sizes 2048x9``: qkv, o, gate_up, down) and change density (one step's
2.7%, a 5-step composed change's 7%), BF16 words, one thread, best of ``--repeats``:

- *3 steps*: ``np.copy`` into fresh pages, ``check_and_write`` (native checked scatter),
  numpy's read-back (``flat[pos] == new``): what the engines did before;
- *one pass*: ``copy_with_writes`` into fresh pages (what the engines now do) and into a
  reused buffer (the pass alone, no page faults);
- *memcpy*: ``np.copyto`` into the reused buffer (the yardstick).

Run: ``python bench/copy_writes.py [--repeats 7] [--scale 1] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from _util import log, machine, table

from rollpatch import native
from rollpatch.engines.writing import check_and_write, copy_with_writes

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
DENSITIES = (0.027, 0.07)


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _three(src: np.ndarray, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
    dst = src.copy()
    check_and_write(dst, pos, old, new, "w")
    if not np.array_equal(dst[pos], new):
        raise AssertionError("read-back")


def _fresh(src: np.ndarray, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
    copy_with_writes(src, np.empty_like(src), pos, old, new, "w")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--scale", type=int, default=1, help="divide every shape's rows by this")
    args = ap.parse_args()
    if native.core is None:
        raise SystemExit("the native core is not built (make setup)")
    rng = np.random.default_rng(0)
    rows, out = [], []
    for module, (n_rows, n_cols) in SHAPES.items():
        n_rows = max(1, n_rows // args.scale)
        label = f"{module} {n_rows}x{n_cols}"
        src = rng.integers(0, 1 << 16, n_rows * n_cols, dtype=np.uint16)
        reused = np.empty_like(src)
        for density in DENSITIES:
            k = int(src.size * density)
            pos = np.sort(rng.choice(src.size, k, replace=False)).astype(np.int64)
            old = src[pos].copy()
            new = old ^ np.uint16(1)

            update = (src, pos, old, new)
            times = {
                "three": _best(partial(_three, *update), args.repeats),
                "fresh": _best(partial(_fresh, *update), args.repeats),
                "into": _best(partial(copy_with_writes, *update[:1], reused, *update[1:], "w"),
                              args.repeats),
                "memcpy": _best(partial(np.copyto, reused, src), args.repeats),
            }  # fmt: skip
            want = src.copy()
            want[pos] = new
            copy_with_writes(src, reused, pos, old, new, "w")
            if not np.array_equal(reused, want):
                raise AssertionError("copy_with_writes is not the copy with the writes")
            log(f"{label} {100 * density:.1f}%: {times}")
            out.append({"shape": label, "density": density, "changes": k, "ms": times})
            rows.append(
                [
                    label,
                    f"{src.nbytes / 2**20:.1f}",
                    f"{100 * density:.1f}",
                    f"{times['three']:.2f}",
                    f"{times['fresh']:.2f}",
                    f"{times['into']:.2f}",
                    f"{times['memcpy']:.2f}",
                    f"{times['fresh'] / times['three']:.2f}",
                    f"{times['into'] / times['memcpy']:.2f}",
                ]
            )
    headers = ["shape (BF16)", "MiB", "chg %", "3 steps ms", "one pass ms", "into reused ms",
               "memcpy ms", "one pass / 3 steps", "reused / memcpy"]  # fmt: skip
    print(table(headers, rows, [False] + [True] * 8))
    m = machine()
    print(
        f"machine: {m['usable_cores']} usable cores ({m['cpu_model']}), load {m['loadavg_1m']:.1f};"
        f" one thread, best of {args.repeats}; every copy checked against numpy's"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": m, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
