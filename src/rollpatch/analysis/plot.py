"""The ``--plot`` figure: changed % per transition, the lag curve, patch bytes vs the view.

Needs matplotlib (the ``plot`` extra); drawn on a bare :class:`matplotlib.figure.Figure` with
the Agg canvas, so no GUI backend and no global pyplot state is touched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .results import Analysis

__all__ = ["require_matplotlib", "write_plot"]


def require_matplotlib(path: str | os.PathLike[str] | None = None) -> Any:
    """The matplotlib.figure module, or ConfigError saying how to install it; with ``path``,
    also a ConfigError when matplotlib cannot write its suffix's format."""
    try:
        from matplotlib import figure
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed",
            hint="pip install 'rollpatch[plot]' (or pip install matplotlib), or drop --plot",
        ) from None
    if path is not None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kinds = FigureCanvasAgg(figure.Figure()).get_supported_filetypes()
        suffix = Path(path).suffix.lower().lstrip(".")
        if suffix not in kinds:
            raise ConfigError(
                f"--plot: cannot write a {suffix or 'suffix-less'} file",
                path=str(path),
                hint="end the name with one of: " + ", ".join(sorted(kinds)),
            )
    return figure


def write_plot(a: Analysis, path: str | os.PathLike[str]) -> None:
    """Write a 2×2 figure of ``a`` to ``path`` (format from the suffix, e.g. .png, .svg)."""
    figure = require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure.Figure(figsize=(12, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_chg, ax_lag), (ax_bytes, ax_lagb) = fig.subplots(2, 2)
    steps = [p.index + 1 for p in a.pairs]
    labels = [f"{p.index}→{p.index + 1}" for p in a.pairs]
    for f in a.formats:
        (line,) = ax_chg.plot(
            steps, [100 * (p.formats[f].changed_frac or 0) for p in a.pairs], "o-", label=f
        )
        if f in a.pairs[0].gaps:
            ax_chg.plot(
                steps,
                [100 * (p.gaps[f]["expected_changed"] or 0) for p in a.pairs],
                ":",
                color=line.get_color(),
                label=f"{f}: rounding model",
            )
        ax_bytes.plot(
            steps,
            [p.formats[f].patch_bytes for p in a.pairs],
            "o-",
            color=line.get_color(),
            label=f"{f} patch",
        )
        ax_bytes.plot(
            steps,
            [p.formats[f].xor_bytes for p in a.pairs],
            "s--",
            color=line.get_color(),
            alpha=0.6,
            label=f"{f} XOR+zstd-3",
        )
        ax_bytes.axhline(a.view_bytes[f], color=line.get_color(), lw=0.8, alpha=0.5)
        ax_bytes.annotate(
            f"full {f} view",
            (steps[0], a.view_bytes[f]),
            fontsize=8,
            va="bottom",
            color=line.get_color(),
        )
        ks = [pt.k for pt in a.lags[f]]
        ax_lag.plot(
            ks,
            [100 * pt.changed / pt.elements for pt in a.lags[f]],
            "o-",
            color=line.get_color(),
            label=f"{f}: one patch 0→k",
        )
        ax_lag.plot(
            ks,
            [100 * pt.steps_changed / pt.elements for pt in a.lags[f]],
            "--",
            color=line.get_color(),
            label=f"{f}: sum of k steps",
        )
        ax_lagb.plot(
            ks,
            [pt.patch_bytes for pt in a.lags[f]],
            "o-",
            color=line.get_color(),
            label=f"{f}: one patch 0→k",
        )
        ax_lagb.plot(
            ks,
            [pt.steps_patch_bytes for pt in a.lags[f]],
            "--",
            color=line.get_color(),
            label=f"{f}: k single patches",
        )
        ax_lagb.axhline(a.view_bytes[f], color=line.get_color(), lw=0.8, alpha=0.5)
        ax_lagb.annotate(
            f"full {f} view",
            (ks[0], a.view_bytes[f]),
            fontsize=8,
            va="bottom",
            color=line.get_color(),
        )
    for ax in (ax_chg, ax_bytes):
        ax.set_xticks(steps, labels, rotation=45 if len(steps) > 12 else 0)
        ax.set_xlabel("transition")
    ax_chg.set_ylabel("served values changed (%)")
    ax_chg.set_title("Changed values per transition")
    ax_bytes.set_yscale("log")
    ax_bytes.set_ylabel("bytes")
    ax_bytes.set_title("Patch bytes per transition vs full view")
    ks = [pt.k for pt in a.lags[a.formats[0]]]
    for ax in (ax_lag, ax_lagb):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel("k (versions behind checkpoint 0)")
    ax_lag.set_ylabel("served values changed (%)")
    ax_lag.set_title("Lag curve: changed values, 0→k vs k steps")
    ax_lagb.set_yscale("log")
    ax_lagb.set_ylabel("bytes")
    ax_lagb.set_title("Lag curve: patch bytes, 0→k vs k patches")
    for ax in (ax_chg, ax_lag, ax_bytes, ax_lagb):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"rollpatch analyze: {len(a.checkpoints)} checkpoints, {a.params:,} params")
    fig.savefig(os.fspath(path), dpi=110)
