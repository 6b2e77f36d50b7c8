"""What ``cast``, ``diff`` and ``publish`` check of a checkpoint's masters, and the cast
they share: served names and dtypes refused up front (naming the tensor), and how many
tensors a quantised format quantises (docs/formats.md §2)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..io.checkpoint import load_masters
from ..view import View

__all__ = ["cast", "masters_of", "quantised_note", "served_dtypes", "warn_quantised"]


def masters_of(path: str) -> dict[str, Any]:
    """The checkpoint's masters under the names ``publish`` serves (a wrapper's prefix off,
    tied aliases dropped: ``publisher.guards.engine_names``), so a cast's digest is the
    published version's (before session 40 a tied ``lm_head`` stayed and the two differed:
    an audit)."""
    from ..publisher.guards import engine_names

    masters = engine_names(load_masters(path))[0]
    served_dtypes(masters, path)
    return masters


#: The dtypes a master may have (``formats.base``): what the publisher casts.
_MASTER_DTYPES = ("float32", "bfloat16", "float16")


def served_dtypes(masters: Mapping[str, Any], path: str) -> None:
    """Refuse, naming it and its dtype, a master no format casts: an int or bool buffer
    (not a served weight: ``analyze`` leaves it out and says so) or a float64 tensor (it
    would round twice). Before, cast's hint spoke of float64 for an int64 tensor (an audit,
    session 41)."""
    for name in sorted(masters):
        dtype = masters[name].dtype.name
        if dtype in _MASTER_DTYPES:
            continue
        if dtype == "float64":
            raise ConfigError(
                f"tensor {name!r} is float64: formats cast float32, bfloat16 or float16 "
                "masters (a float64 one would round twice)",
                path=path,
                hint="save the checkpoint in float32 (or bfloat16)",
            )
        raise ConfigError(
            f"tensor {name!r} is {dtype}: int and bool tensors are buffers, not served "
            "weights; cast, diff and publish serve float tensors only (analyze leaves them "
            "out)",
            path=path,
            hint="save the checkpoint without its buffers (the model's parameters only)",
        )


def cast(
    masters: dict[str, Any], args: argparse.Namespace, policy: Any, previous: View | None
) -> View:
    """The view ``publish`` serves of ``masters`` (:func:`masters_of`) under ``args``'
    ``--format`` and ``--scales`` and the quantisation ``policy``."""
    from ..formats import cast_view
    from ..io.names import check_names

    view = cast_view(
        masters,
        args.format,
        policy=policy,
        scales=args.scales,
        previous=previous,
    )
    check_names(view)  # the served names: a quantised format adds suffixes to the masters'
    return view


def quantised_note(masters: Mapping[str, Any], fmt: str, policy: Any) -> str:
    """``", N of M tensors quantised"`` under a quantised format ("" under ``bf16`` and
    ``fp16``); when it quantises none, one warning line on stderr: a typo in ``--include``,
    or shapes the format cannot block, gave a view labelled ``nvfp4`` that is plain BF16
    (an audit, session 41)."""
    from ..formats import get_format

    f = get_format(fmt)
    if not f.scale_suffixes:
        return ""
    n = sum(f.quantises(name, tuple(a.shape), policy) for name, a in masters.items())
    warn_quantised(fmt, n, len(masters))
    return f", {n} of {len(masters)} tensors quantised"


def warn_quantised(fmt: str, quantised: int, tensors: int) -> None:
    """One warning line on stderr when quantised format ``fmt`` quantises none of the
    ``tensors`` (cast, diff, publish and analyze: the last one did not say, an audit)."""
    from ..formats import get_format

    if quantised or not tensors:
        return
    plain = get_format(fmt).plain_kind.upper()
    print(
        f"rollpatch: warning: {fmt} quantises none of the {tensors} tensors: the view is "
        f"plain {plain} (check --include/--exclude, and the shapes the format can block: "
        "docs/formats.md §2)",
        file=sys.stderr,
    )
