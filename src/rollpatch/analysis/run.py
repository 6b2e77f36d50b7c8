"""Walk a run of master checkpoints and measure what rollpatch would ship between them.

Memory: one transition at a time. Held at once: the previous and current masters (memory-
mapped for safetensors and torch files), the previous and current served views of each format,
and the served views of checkpoint 0 (for the lag curve).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import ConfigError
from ..formats import QuantPolicy, cast_view, get_format
from ..formats.base import SCALE_MODES
from ..io.checkpoint import load_masters
from ..io.names import check_names
from ..patch import diff, encode, inspect
from ..view import View
from .bounds import iid_bound_bits, xor_zstd
from .experts import expert_step
from .gaps import GapStats
from .groups import GROUPS, tensor_group
from .progress import Progress
from .results import Analysis, FormatStep, GroupStep, LagPoint, PairResult

__all__ = ["analyze_run", "lag_points", "load_checkpoint", "measure"]

_MASTER_DTYPES = ("float32", "bfloat16", "float16")


def lag_points(transitions: int) -> list[int]:
    """k = 1, 2, 4, 8, ... up to ``transitions``, and ``transitions`` itself."""
    ks, k = [], 1
    while k <= transitions:
        ks.append(k)
        k *= 2
    if transitions >= 1 and ks[-1] != transitions:
        ks.append(transitions)
    return ks


def analyze_run(
    checkpoints: Sequence[str | os.PathLike[str]],
    *,
    formats: Sequence[str] = ("bf16",),
    scales: str = "bf16",
    policy: QuantPolicy | None = None,
    progress: bool | None = None,
) -> Analysis:
    """Measure every consecutive transition of ``checkpoints`` under each format.

    A checkpoint is a safetensors or torch state-dict file, or a folder of shards (see
    :func:`load_checkpoint`); tensors that are not float32/bfloat16/float16 are left out and
    listed in ``Analysis.skipped``.

    ``scales`` and ``policy`` are passed to :func:`rollpatch.formats.cast_view` (``frozen``
    reuses each checkpoint's previous view, as a publisher would). ``progress``: show a bar
    on stderr (None: only when stderr is a terminal). Raises ConfigError for fewer than two
    checkpoints, unknown formats, or checkpoints whose tensor names or shapes differ.
    """
    paths = [str(p) for p in checkpoints]
    if len(paths) < 2:
        raise ConfigError(
            "analyze needs at least two checkpoints",
            count=len(paths),
            hint="pass consecutive checkpoints of one run, oldest first",
        )
    fmts = list(dict.fromkeys(formats))
    if not fmts:
        raise ConfigError("analyze needs at least one format", hint="e.g. formats=('bf16',)")
    for f in fmts:
        get_format(f)
    if scales not in SCALE_MODES:
        raise ConfigError(
            f"unknown scale mode {scales!r}", hint=f"use one of {', '.join(SCALE_MODES)}"
        )
    walk = _Walk(paths, fmts, scales, policy)
    t_start = time.perf_counter()
    workers = max(1, min(4, os.cpu_count() or 1))
    with (
        Progress(walk.units, "analyze", enabled=progress) as bar,
        ThreadPoolExecutor(workers) as pool,
    ):
        out = walk.start(bar)
        for i in range(1, len(paths)):
            walk.transition(i, out, bar, pool)
    out.seconds = time.perf_counter() - t_start
    return out


class _Walk:
    """The state carried from one transition to the next (see the module docstring)."""

    def __init__(
        self, paths: list[str], fmts: list[str], scales: str, policy: QuantPolicy | None
    ) -> None:
        self.paths, self.fmts, self.scales, self.policy = paths, fmts, scales, policy
        self.cast = {f: _caster(f, scales, policy) for f in fmts}
        self.lags = [k for k in lag_points(len(paths) - 1) if k > 1]
        self.grids = ["bf16"] + (["fp16"] if "fp16" in fmts else [])
        #: progress units: first load, then per transition one load + one per format, lags
        self.units = 1 + (len(paths) - 1) * (1 + len(fmts)) + len(self.lags) * len(fmts)
        self.layout: dict[str, tuple[int, ...]] = {}
        self.prev_m: dict[str, np.ndarray] = {}
        self.prev_v: dict[str, View] = {}
        self.first: dict[str, View] = {}

    def start(self, bar: Progress) -> Analysis:
        """Load and cast checkpoint 0; the Analysis to fill."""
        bar.stage(f"load + cast {os.path.basename(self.paths[0])}")
        self.prev_m, skipped = _floats(load_checkpoint(self.paths[0]))
        if not self.prev_m:
            raise ConfigError("the checkpoint has no float tensors to serve", path=self.paths[0])
        self.layout = {n: a.shape for n, a in self.prev_m.items()}
        group_params = {g: 0 for g in GROUPS}
        for n, a in self.prev_m.items():
            group_params[tensor_group(n)] += int(a.size)
        self.first = {f: self.cast[f](self.prev_m, None) for f in self.fmts}
        for v in self.first.values():  # the served names (a quantised format adds suffixes):
            check_names(v)  # what cast, diff and publish refuse (before, analyze passed them)
        self.prev_v = dict(self.first)
        bar.update()
        return Analysis(
            checkpoints=self.paths,
            formats=self.fmts,
            scales=self.scales,
            tensors=len(self.layout),
            params=sum(group_params.values()),
            group_params=group_params,
            skipped=skipped,
            view_bytes={f: v.nbytes for f, v in self.first.items()},
            quantised={
                f: sum(
                    get_format(f).quantises(n, a.shape, self.policy) for n, a in self.prev_m.items()
                )
                for f in self.fmts
                if get_format(f).scale_suffixes
            },
            lags={f: [] for f in self.fmts},
        )

    def transition(self, i: int, out: Analysis, bar: Progress, pool: ThreadPoolExecutor) -> None:
        """Measure checkpoint i-1 → i (and the lag point 0 → i when i is one)."""
        bar.stage(f"{i - 1}→{i}: load {os.path.basename(self.paths[i])}, update/gap")
        cur_m, left_out = _floats(load_checkpoint(self.paths[i]))
        _check_layout(self.layout, cur_m, self.paths[0], self.paths[i], left_out)
        gaps = _gaps(self.prev_m, cur_m, self.grids)
        bar.update()
        steps: dict[str, FormatStep] = {}
        for f in self.fmts:
            bar.stage(f"{i - 1}→{i}: {f} cast, diff, encode")
            cur_v = self.cast[f](cur_m, self.prev_v[f])
            steps[f] = measure(f, self.prev_v[f], cur_v, pool)
            bar.update()
            if i == 1:
                s = steps[f]
                out.lags[f].append(
                    LagPoint(1, s.elements, s.changed, s.patch_bytes, s.changed, s.patch_bytes)
                )
            elif i in self.lags:
                bar.stage(f"lag 0→{i}: {f} diff, encode")
                out.lags[f].append(_lag(self.first[f], cur_v, i, out.pairs, steps[f]))
                bar.update()
            self.prev_v[f] = cur_v
        out.pairs.append(PairResult(i - 1, steps, gaps))
        self.prev_m = cur_m


def _caster(
    fmt: str, scales: str, policy: QuantPolicy | None
) -> Callable[[Mapping[str, np.ndarray], View | None], View]:
    def cast(masters: Mapping[str, np.ndarray], previous: View | None) -> View:
        return cast_view(masters, fmt, policy=policy, scales=scales, previous=previous)

    return cast


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Masters of one checkpoint: a file, or a folder (a Hugging Face model directory, its
    shards as its index names them): :func:`rollpatch.io.checkpoint.load_masters`."""
    return load_masters(path)


def _floats(masters: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(the float tensors rollpatch would serve, name → why the others are left out)."""
    keep, skipped = {}, {}
    for name, a in masters.items():
        if a.dtype.name in _MASTER_DTYPES:
            keep[name] = a
        elif a.dtype.name == "float64":
            skipped[name] = "float64 (formats take float32/bfloat16/float16 masters)"
        else:
            skipped[name] = f"not a float tensor ({a.dtype.name})"
    return keep, skipped


def _check_layout(
    layout: Mapping[str, tuple[int, ...]],
    masters: Mapping[str, np.ndarray],
    first: str,
    path: str,
    left_out: Mapping[str, str] | None = None,
) -> None:
    missing = sorted(set(layout) - set(masters))
    extra = sorted(set(masters) - set(layout))
    left_out = left_out or {}
    retyped = [n for n in missing if n in left_out]
    if retyped:  # there, but of a dtype left out (float64, ints): say so, not "missing"
        n = retyped[0]
        raise ConfigError(
            f"tensor {n!r} is {left_out[n]} in {path} but a served float in {first}",
            path=path,
            first=first,
            tensors=_few(retyped),
            hint="pass checkpoints of one run, saved in the same dtypes",
        )
    if missing or extra:
        raise ConfigError(
            "checkpoints hold different tensor sets",
            path=path,
            first=first,
            missing=_few(missing) or None,
            extra=_few(extra) or None,
            hint="pass checkpoints of one run (same model, same naming)",
        )
    reshaped = sorted(n for n, a in masters.items() if a.shape != layout[n])
    if reshaped:
        raise ConfigError(
            "tensor shapes differ between checkpoints",
            path=path,
            first=first,
            tensors=_few(reshaped),
            hint="pass checkpoints of one run (same model, same naming)",
        )


def _few(names: list[str], limit: int = 5) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _gaps(
    old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], grids: Sequence[str]
) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for grid in grids:
        by_group = {g: GapStats(grid) for g in GROUPS}
        for name, a in old.items():
            by_group[tensor_group(name)].add(a, new[name])
        whole = GapStats(grid)
        for s in by_group.values():
            whole.merge(s)
        out[grid] = {
            **whole.summary(),
            "groups": {g: s.summary() for g, s in by_group.items() if s.elements},
        }
    return out


def measure(fmt: str, old: View, new: View, pool: ThreadPoolExecutor) -> FormatStep:
    """Diff, encode and size one transition ``old`` → ``new`` (same layout)."""
    t0 = time.perf_counter()
    patch = diff(old, new)
    blob = encode(patch, old)
    n, k, whole, per = iid_bound_bits(patch, old)
    elements = {g: 0 for g in GROUPS}
    changed = {g: 0 for g in GROUPS}
    payload = {g: 0 for g in GROUPS}
    for name, t in old.items():
        elements[tensor_group(name)] += t.n_elements
    for name, tp in patch.tensors.items():
        changed[tensor_group(name)] += tp.n_changed
    for e in inspect(blob).tensors:
        payload[tensor_group(e["name"])] += int(e["length"])
    experts = expert_step(old, patch)
    del patch
    names = sorted(new)
    xor = sum(pool.map(lambda m: len(xor_zstd(old[m].data, new[m].data)), names))
    groups = {g: GroupStep(elements[g], changed[g], payload[g]) for g in GROUPS if elements[g]}
    return FormatStep(
        format=fmt,
        elements=n,
        changed=k,
        view_bytes=old.nbytes,
        patch_bytes=len(blob),
        bound_bits=whole,
        bound_tensor_bits=per,
        xor_bytes=xor,
        groups=groups,
        seconds=time.perf_counter() - t0,
        experts=experts,
    )


def _lag(first: View, cur: View, k: int, pairs: list[PairResult], last: FormatStep) -> LagPoint:
    patch = diff(first, cur)
    blob = encode(patch, first)
    fmt = last.format
    steps = [p.formats[fmt] for p in pairs] + [last]
    return LagPoint(
        k,
        sum(t.n_elements for t in first.values()),
        patch.n_changed,
        len(blob),
        sum(s.changed for s in steps[:k]),
        sum(s.patch_bytes for s in steps[:k]),
    )
