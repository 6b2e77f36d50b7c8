"""Lossless patches between served views: diff, apply, compose, encode, decode.

``apply(a, decode(encode(diff(a, b), a), a)) == b`` bit for bit, for every kind. See
docs/patch-format.md for the wire format.
"""

from ..view import View
from .differ import diff
from .inplace import apply_encoded
from .model import DeltaOp, DropOp, FullOp, Op, Patch, TensorPatch
from .ops import apply, compose
from .unwire import decode
from .wire import PatchHeader, encode, encode_views, encode_views_patch, inspect

__all__ = [
    "DeltaOp",
    "DropOp",
    "FullOp",
    "Op",
    "Patch",
    "PatchHeader",
    "TensorPatch",
    "apply",
    "apply_bytes",
    "apply_encoded",
    "compose",
    "decode",
    "diff",
    "encode",
    "encode_views",
    "encode_views_patch",
    "inspect",
]


def apply_bytes(view: View, blob: bytes | memoryview, *, verify: bool = False) -> View:
    """Decode ``blob`` against ``view`` and apply it in place; returns the view."""
    if verify:
        return apply(view, decode(blob, view), verify=True)
    return apply_encoded(view, blob)
