"""Analysis of a training run: what rollpatch would ship between its checkpoints, and why.

:func:`analyze_run` walks consecutive master checkpoints and measures, per transition and per
served format: the share of served values that change (whole model and by tensor group), the
real patch size and its ratio to the i.i.d. bound and to XOR+zstd-3, the size of master
updates relative to the rounding gap, and the lag curve (one patch 0→k vs k single steps).
``rollpatch analyze`` is its command line; docs/analyze.md explains every number.
"""

from .bounds import binary_bits, entropy_bits, histogram, iid_bound_bits, xor_zstd
from .gaps import GapStats
from .groups import GROUPS, tensor_group
from .report import render
from .results import Analysis, FormatStep, GroupStep, LagPoint, PairResult
from .run import analyze_run, lag_points, load_checkpoint, measure

__all__ = [
    "GROUPS",
    "Analysis",
    "FormatStep",
    "GapStats",
    "GroupStep",
    "LagPoint",
    "PairResult",
    "analyze_run",
    "binary_bits",
    "entropy_bits",
    "histogram",
    "iid_bound_bits",
    "lag_points",
    "load_checkpoint",
    "measure",
    "render",
    "tensor_group",
    "xor_zstd",
]
