"""bench/codec.py's rows (the measurements per size, lr, format and threads) and their
report: the table, its ratios and the machine line."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from _util import (
    machine_line,
    table,
)

METHODS = ("native", "inc", "numpy", "xor1", "xor3", "memcpy")


@dataclass
class Row:
    """Accumulated measurements of one (size, lr, format, threads) over its transitions."""

    size: str
    n_params: int
    lr: float
    format: str
    threads: int
    transitions: int = 0
    view_bytes: int = 0
    elements: int = 0
    changed: int = 0
    patch_bytes: int = 0
    bound_bits: float = 0.0
    xor1_bytes: int = 0
    xor3_bytes: int = 0
    enc_s: dict[str, float] = field(default_factory=lambda: {m: 0.0 for m in METHODS})
    dec_s: dict[str, float] = field(default_factory=lambda: {m: 0.0 for m in METHODS})
    enc_extra: int = 0
    enc_first: int = 0
    peak_rss: int = 0
    #: rp/xor1 time ratio of every round (paired: the same round), "enc" and "dec"
    round_ratios: dict[str, list[float]] = field(default_factory=lambda: {"enc": [], "dec": []})
    per_step: list[dict[str, Any]] = field(default_factory=list)


def _ms(seconds: float, n: int) -> str:
    return "-" if math.isnan(seconds) else f"{1e3 * seconds / n:.0f}"


def _x(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) or b <= 0 else f"{a / b:.2f}"


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def render(rows: Sequence[Row], mach: dict, wall_s: float, load: tuple[float, float]) -> str:
    headers = [
        "size",
        "lr",
        "format",
        "T",
        "view",
        "chg %",
        "patch %",
        "/bound",
        "xor1 x",
        "enc ms: rp",
        "numpy",
        "xor1",
        "xor3",
        "rp/xor1",
        "rounds",
        "dec+ap ms: rp",
        "rp inc",
        "numpy",
        "xor1",
        "xor3",
        "rp/xor1",
        "rounds",
        "inc/xor1",
        "memcpy ms",
        "enc mem",
        "1st enc",
    ]
    body = []
    for r in rows:
        n = r.transitions
        e, d = r.enc_s, r.dec_s
        body.append(
            [
                r.size,
                f"{r.lr:.0e}",
                r.format,
                str(r.threads),
                f"{r.view_bytes / n / 1e9:.2f} GB",
                f"{100 * r.changed / r.elements:.3f}",
                f"{100 * r.patch_bytes / r.view_bytes:.3f}",
                f"{8 * r.patch_bytes / r.bound_bits:.3f}" if r.bound_bits else "-",
                f"{r.xor1_bytes / r.patch_bytes:.2f}",
                _ms(e["native"], n),
                _ms(e["numpy"], n),
                _ms(e["xor1"], n),
                _ms(e["xor3"], n),
                _x(e["native"], e["xor1"]),
                _spread(r.round_ratios["enc"]),
                _ms(d["native"], n),
                _ms(d["inc"], n),
                _ms(d["numpy"], n),
                _ms(d["xor1"], n),
                _ms(d["xor3"], n),
                _x(d["native"], d["xor1"]),
                _spread(r.round_ratios["dec"]),
                _x(d["inc"], d["xor1"]),
                _ms(e["memcpy"], n),
                f"{r.enc_extra / (r.patch_bytes / n):.1f}x",
                f"{r.enc_first / (r.patch_bytes / n):.1f}x",
            ]
        )
    right = [False, True, False] + [True] * (len(headers) - 3)
    n_steps = sorted({r.transitions for r in rows})
    foot = [
        "",
        (
            f"machine: {machine_line(mach)}; load avg {load[0]:.1f} at start, {load[1]:.1f} at "
            f"end; {wall_s / 60:.1f} min wall"
        ),
        (
            f"each row: {'/'.join(map(str, n_steps))} consecutive AdamW steps of rollpatch.sim "
            "(Adam state warm at step 1000), views cast with scales=bf16; T = threads"
        ),
        "chg %    changed elements / all elements of the served view (4-bit codes count one each)",
        "patch %  rollpatch patch bytes (format 2, header included) / view bytes",
        "/bound   patch bits / i.i.d. bound n*H(k/n) + k*H(d) over the whole view",
        "xor1 x   XOR+zstd-1 bytes / rollpatch bytes",
        (
            "enc ms   per transition: rp = native encode_views (compares every word; the new "
            "view's sum128 = the old's + the change); numpy = reference diff+encode;"
        ),
        (
            "         xor1/xor3 = XOR + zstd-1/-3 + xxh3-128 of the new tensor (Stitch's "
            "method; per thread one scratch buffer and zstd context reused, decompressed into "
            "it: since session 44, before which each tensor's XOR and frame were fresh arrays); "
            "rp/xor1 = the ratio"
        ),
        (
            "dec+ap   decode + apply with every check (rollpatch: apply_encoded, one pass per chunk; "
            "base, target and root digests, the touched tensors re-hashed; XOR: xxh3-128)"
        ),
        (
            "rp inc   the same with O(change) digests: sum128(new) = sum128(old) + the change of "
            "the written words (exact for what the patch wrote; blind to bits flipped behind the "
            "view's back, which the engines' background audit catches: docs/engines.md)"
        ),
        (
            "rounds   min-max over the timing rounds of the same round's rp/xor1 time ratio "
            "(a best-of ratio outside it, or a range wider than a claimed margin, is noise)"
        ),
        "memcpy   copying the view with T threads (the physical yardstick)",
        (
            "enc mem  peak RSS growth during a native encode after the row's timed ones (what a "
            "publisher pays per version) / patch bytes (the two views are resident before; C heap "
            "trimmed before it); 1st enc: the same for the row's first encode, with what the "
            "process sets up for the row once (the header's zstd context grown to the row's "
            "header, the C heap's first use of T threads)"
            + (
                f"; a process's first encodes set up {mach['first_encode_rss'] / 1e6:.2f} MB once "
                "(header zstd context, thread pool), in no row"
                if "first_encode_rss" in mach
                else ""
            )
        ),
        "every round trip of every method verified bit-exact; "
        + (
            "numpy bytes == native bytes (rows with numpy times)"
            if any(math.isfinite(r.enc_s["numpy"]) and r.enc_s["numpy"] > 0 for r in rows)
            else "numpy reference not run (--numpy-max): its bytes were not compared here"
        ),
    ]
    return table(headers, body, right) + "\n" + "\n".join(foot)
