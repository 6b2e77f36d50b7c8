"""``rollpatch cast | diff | apply | inspect``: formats and patches on files."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..io import load_view, save_view
from ..view import View
from .casting import cast, masters_of, quantised_note
from .flags import add_config_flags, config_kwargs

__all__ = [
    "format_args",
    "policy_args",
    "policy_from_args",
    "quant_args",
    "register",
    "write_atomic",
]


def register(sub: Any) -> None:
    p = sub.add_parser("cast", help="cast a master checkpoint to a served view (safetensors)")
    p.add_argument(
        "ckpt",
        help="master checkpoint: .safetensors, a torch state dict file, or a Hugging Face "
        "model folder",
    )
    format_args(p)
    p.add_argument("--previous", help="previous view whose scales --scales frozen reuses")
    p.add_argument("-o", "--output", required=True, help="output view (.safetensors)")
    p.set_defaults(func=cmd_cast)

    p = sub.add_parser(
        "diff",
        help="make a patch between two checkpoints (or views)",
        epilog="--scales frozen needs the run's views: a frozen run's view of OLD holds the "
        "scales of its first version, which OLD alone does not give. Cast them in order "
        "(rollpatch cast CKPT --scales frozen --previous PREV.safetensors -o VIEW) and diff "
        "the views (rollpatch diff --views OLD_VIEW NEW_VIEW).",
    )
    p.add_argument("old", help="old checkpoint (file or model folder), or view with --views")
    p.add_argument("new", help="new checkpoint (file or model folder), or view with --views")
    format_args(p)
    p.add_argument(
        "--views", action="store_true", help="OLD and NEW are served views already (no casting)"
    )
    p.add_argument("-o", "--output", required=True, help="output patch file")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("apply", help="apply a patch to a view; OUT is written only if verified")
    p.add_argument("view")
    p.add_argument("patch")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--verify", action="store_true", help="re-hash the base before applying")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("inspect", help="show a patch's tensors, sizes and digests")
    p.add_argument("patch")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)


def format_args(p: argparse.ArgumentParser) -> None:
    """--format, --scales and the quantisation policy's flags, made from ``PublisherConfig``'s
    and ``QuantPolicy``'s fields."""
    from ..publisher.config import PublisherConfig

    add_config_flags(p, PublisherConfig, only=("format",))
    quant_args(p)


def quant_args(p: argparse.ArgumentParser) -> None:
    """--scales and the quantisation policy's flags (docs/formats.md)."""
    from ..publisher.config import PublisherConfig

    add_config_flags(p, PublisherConfig, only=("scales",))
    policy_args(p)


def policy_args(p: argparse.ArgumentParser) -> None:
    """--include, --exclude, --quantise-routers: which tensors a quantised format quantises
    (the fields of :class:`~rollpatch.formats.QuantPolicy`)."""
    from ..formats import QuantPolicy

    add_config_flags(p, QuantPolicy)


def policy_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~rollpatch.formats.QuantPolicy` the flags of :func:`policy_args` chose."""
    from ..formats import QuantPolicy

    return QuantPolicy(**config_kwargs(args, QuantPolicy))


def _files(args: argparse.Namespace, **inputs: str) -> None:
    """The command's input files (attribute → what it is) and its -o, checked first."""
    from .preflight import input_file, output_file

    given = [getattr(args, attr) for attr in inputs if getattr(args, attr, None)]
    for attr, what in inputs.items():
        if getattr(args, attr, None):
            input_file(getattr(args, attr), what, folder=what.endswith("checkpoint"))
    if getattr(args, "output", None):
        output_file(args.output, inputs=given)


def cmd_cast(args: argparse.Namespace) -> int:
    _files(args, ckpt="checkpoint", previous="previous view")
    previous = load_view(args.previous) if args.previous else None
    masters, policy = masters_of(args.ckpt), policy_from_args(args)
    view = cast(masters, args, policy, previous)
    if not len(view):  # as publish refuses it: a view of nothing serves no engine
        raise ConfigError("the checkpoint holds no tensors: nothing to cast", path=args.ckpt)
    note = quantised_note(masters, args.format, policy)
    save_view(view, args.output)
    print(
        f"{args.output}: {len(view)} tensors, {view.nbytes:,} bytes, {args.format}{note}, "
        f"digest {view.digest()[:16]}"
    )
    return 0


def whole_note(dropped: int, whole: int, whole_elements: int | None = None) -> str:
    """What a patch does besides changing elements: tensors dropped, or shipped whole (with
    ``whole_elements``, how many elements those hold; "" for neither)."""
    held = "" if whole_elements is None else f" ({whole_elements:,} elements)"
    parts = [
        f"{n} tensor{'s' * (n != 1)} {what}"
        for n, what in (
            (dropped, "dropped"),
            (whole, f"shipped whole{held}: added, reshaped or retyped"),
        )
        if n
    ]
    return "; " + ", ".join(parts) if parts else ""


def cmd_diff(args: argparse.Namespace) -> int:
    from ..patch import diff, encode
    from ..patch.model import FullOp

    what = "view" if args.views else "checkpoint"
    note = ""
    if not args.views and args.scales == "frozen":  # before any file is read
        raise ConfigError(
            "diff --scales frozen of checkpoints: OLD would be cast with fresh scales, which "
            "is no view of a frozen run (its scales are its first version's), and the patch "
            "would apply to none",
            hint="cast each checkpoint with --scales frozen --previous PREV.safetensors, "
            "then diff --views OLD_VIEW NEW_VIEW",
        )
    _files(args, old=f"old {what}", new=f"new {what}")
    if args.views:
        from ..io.names import check_names

        old, new = load_view(args.old), load_view(args.new)
        check_names(old)  # as a patch header takes them (cast and diff check theirs)
        check_names(new)
    else:
        policy = policy_from_args(args)
        old = cast(masters_of(args.old), args, policy, None)
        masters = masters_of(args.new)
        new = cast(masters, args, policy, None)
        note = quantised_note(masters, args.format, policy)
    patch = diff(old, new)
    # the target's format labels travel with the patch: apply writes them (a cross-format
    # patch applied under the base's label was an audit's finding, session 41)
    labels = {k: new.metadata[k] for k in _LABELS if k in new.metadata}
    patch = dataclasses.replace(patch, meta={**patch.meta, **labels})
    blob = encode(patch, old)
    write_atomic(Path(args.output), blob)
    n = sum(t.n_elements for t in old.values())
    ops = [t.op for t in patch.tensors.values()]
    whole = [t for t in patch.tensors.values() if isinstance(t.change, FullOp)]
    print(
        f"{args.output}: {patch.n_changed:,} of {n:,} elements changed"
        + (" in place" if whole else "")
        + f" ({100 * patch.n_changed / max(n, 1):.3f}%)"
        + whole_note(ops.count("drop"), len(whole), sum(math.prod(t.shape) for t in whole))
        + f", {len(blob):,} bytes"
        + (f" ({100 * len(blob) / old.nbytes:.3f}% of the view)" if old.nbytes else "")
        + note
    )
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    from ..patch import apply, decode

    _files(args, view="view", patch="patch")
    view = load_view(args.view)
    blob = Path(args.patch).read_bytes()
    patch = decode(blob, view)
    apply(view, patch, verify=args.verify)
    note = _relabel(view, patch)
    save_view(view, args.output)
    # the digest the patch's target names (inspect shows it), with its algorithm's name: a
    # format-1 patch's is rp.blake3.v1, not the default rp.sum128.v1 (an audit, session 41)
    digest = view.digest(patch.digest)
    print(f"{args.output}: verified, digest {patch.digest} {digest[:16]}{note}")
    return 0


#: The view metadata that says what format a view is in (``formats.cast_view``).
_LABELS = ("rollpatch.format", "rollpatch.scales")


def _relabel(view: View, patch: Any) -> str:
    """Give the applied ``view`` the format labels of the patch's target: those the patch
    carries (``rollpatch diff`` writes them), else the base's when the patch changes no
    tensor's kind or name; else none (unknown), said in the returned note."""
    from ..patch.model import DeltaOp

    carried = {k: patch.meta[k] for k in _LABELS if k in patch.meta}
    if carried:
        view.metadata.update(carried)
        return ""
    if all(isinstance(t.change, DeltaOp) for t in patch.tensors.values()):
        return ""  # the same tensors, kinds and shapes: the base's format
    dropped = [k for k in _LABELS if view.metadata.pop(k, None) is not None]
    if not dropped:
        return ""
    return "; the patch adds, drops or retypes tensors and names no format: label left out"


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..patch import inspect

    _files(args, patch="patch")
    blob = Path(args.patch).read_bytes()
    info = inspect(blob)
    if args.json:
        json.dump({**info.to_json(), "file_bytes": len(blob)}, sys.stdout, indent=1)
        print()
        return 0
    print(
        f"patch {_shown(args.patch)}: {len(blob):,} bytes (header {info.header_bytes:,}, "
        f"payload {info.payload_bytes:,}), patch format {info.version}"
    )
    algo = _shown(info.digest)
    print(f"base   {algo} {_shown(info.base)}\ntarget {algo} {_shown(info.target)}")
    for k, v in sorted(info.meta.items()):
        print(f"meta   {_shown(k)} = {_shown(v)}")
    by_codec: dict[str, int] = {}
    rows = []
    for e in info.tensors:
        codec = _shown(e["codec"])
        by_codec[codec] = by_codec.get(codec, 0) + e["length"]
        rows.append(
            (
                _shown(e["name"]),
                _shown(e["op"]),
                _shown(e["kind"]),
                "x".join(map(str, e["shape"])) or "scalar",
                f"{e['changed']:,}",
                codec,
                f"{e['length']:,}",
            )
        )
    head = ("tensor", "op", "kind", "shape", "changed", "codec", "bytes")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    ops = [e["op"] for e in info.tensors]
    print(
        f"{len(rows)} tensors, {info.n_changed:,} changed elements"
        + whole_note(ops.count("drop"), ops.count("full"))
        + "; bytes by codec: "
        + ", ".join(f"{c} {b:,}" for c, b in sorted(by_codec.items()))
    )
    return 0


def _shown(value: object) -> str:
    """Text from a file, safe for a terminal: control characters (escape sequences), other
    non-printables and lone surrogates are shown escaped (``\\x1b``), never emitted raw."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
        for c in text
    )


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (temp file, fsync, rename); a failure names ``path``,
    not the temp file, which is removed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
