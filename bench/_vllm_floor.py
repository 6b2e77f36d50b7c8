"""bench/vllm.py's floor of an in-place pause: what any in-place write of one staged update
costs on the built-in engine, against what its commit does with it.

At RL change rates a change falls in about every other cache line of a touched tensor, so
writing the changes in place streams about as much memory as the tensors themselves
(docs/engines.md, *What bounds an in-place pause*). Here the last staged update of the
built-in engine's in-place syncs is written again, in this process, as:

- **commit's writes**: :func:`rollpatch.engines.writing.write_params` as the adapter calls it
  (slices of old words compared, then scattered, then read back; tensors on every core);
- **scatter (floor)**: a plain numpy scatter of the new words, one thread, no check and no
  read-back: what no in-place commit can go below;
- **one read pass**: the rp.sum128 of every tensor of the model (the memory bandwidth).

Each variant writes the update forward (timed) and back (untimed), alternated, ``reps``
times; min and median wall time. The engine is left holding what it held (checked: the touched
tensors re-hashed equal their cached states).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from _vllm_server import BenchError

from rollpatch.engines.writing import ParamWrites, numpy_access, write_params
from rollpatch.view import sum128


def inplace_floor(engine: Any, staged: Any, reps: int = 5) -> dict[str, Any]:
    """Time the variants above on ``staged`` (the last update ``engine`` committed in place)."""
    view = engine.runtime.view
    ts = {n: t for n, t in staged.tensors.items() if not view[n].kind.packed}
    fwd = {n: ParamWrites(t.positions, t.old, t.new) for n, t in ts.items()}
    back = {n: ParamWrites(t.positions, t.new, t.old) for n, t in ts.items()}
    acc = numpy_access({n: view[n].data for n in ts})

    def commit(w: dict[str, ParamWrites]) -> None:
        write_params(acc, w, parallel=True)

    def scatter(w: dict[str, ParamWrites]) -> None:
        for n, x in w.items():
            view[n].data[x.prepared] = x.new

    def read(_: dict[str, ParamWrites]) -> None:
        for n in view:
            sum128(view[n].data)

    variants = {"commit_writes": commit, "scatter_floor": scatter, "read_pass": read}
    runs: dict[str, list[float]] = {k: [] for k in variants}
    with engine.runtime.commit():  # no forward pass reads half-written weights meanwhile
        for _ in range(reps):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn(back)  # the held words are the update's new ones: write it back first
                runs[name].append(time.perf_counter() - t0)
                if name != "read_pass":
                    fn(fwd)
        for n in ts:
            if sum128(view[n].data) != view.sum_state(n):
                raise BenchError(f"the floor's writes left {n} changed")
    return {
        "changed": int(sum(t.positions.size for t in ts.values())),
        "runs_s": runs,
        "min_s": {k: min(v) for k, v in runs.items()},
        "median_s": {k: statistics.median(v) for k, v in runs.items()},
    }


def render_floor(floor: dict[str, Any] | None, load_s: float) -> str:
    """One line: the floor's medians in ms and as a share of the full load's pause."""
    if not floor:
        return ""
    med = floor["median_s"]
    parts = ", ".join(
        f"{label} {1e3 * med[k]:.1f} ms ({100 * med[k] / load_s:.0f}%)"
        for k, label in (
            ("commit_writes", "commit's checked writes + read-back"),
            ("scatter_floor", "plain scatter, no check (floor)"),
            ("read_pass", "one read pass of the model"),
        )
    )
    return (
        f"built-in in-place floor, the last staged update ({floor['changed']:,} changes), "
        f"median wall of {len(floor['runs_s']['read_pass'])}, % of the full load's pause: {parts}"
    )
