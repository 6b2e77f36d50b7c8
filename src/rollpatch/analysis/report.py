"""The text report of ``rollpatch analyze`` (the JSON form is ``Analysis.to_json()``)."""

from __future__ import annotations

from collections.abc import Sequence

from .experts import QUANTILES, ExpertRate, ExpertStep
from .groups import GROUPS
from .results import Analysis, ratio

__all__ = ["human_bytes", "render"]

_GROUP_LABELS = {
    "embeddings": "embed",
    "attention": "attn",
    "mlp": "mlp",
    "experts": "experts",
    "router": "router",
    "norms": "norms",
    "lm_head": "lm_head",
    "other": "other",
}


def human_bytes(n: float | None) -> str:
    """Decimal units: 1234567 → ``1.23 MB``."""
    if n is None:
        return "-"
    for unit, mult in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= mult:
            x = n / mult
            return f"{x:.{2 if x < 10 else 1 if x < 100 else 0}f} {unit}"
    return f"{n:.0f} B"


def _pct(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Fixed-width table; the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def render(a: Analysis) -> str:
    """The whole report, one section per question (see docs/analyze.md)."""
    out = _head(a)
    out += ["", "Changed values and patch size per transition"]
    out += _steps(a)
    for f in a.formats:
        out += [
            "",
            (
                f"Changed % by tensor group, {f} (last rows: each group's share of the "
                "view and of the patch)"
            ),
        ]
        out += _groups(a, f)
        if a.pairs[0].formats[f].experts is not None:
            out += ["", f"Routed experts and routers, {f}: changed % per expert"]
            out += _experts(a, f)
    out += [
        "",
        (
            "Update size vs rounding gap: r = |master_new - master_old| / ulp of the "
            "served old value"
        ),
    ]
    out += _gaps(a)
    for f in a.formats:
        out += [
            "",
            (f"Lag curve, {f}: one patch 0→k vs the k single-step patches (ratio < 1: sub-linear)"),
        ]
        out += _lag(a, f)
    out += ["", "Summary"]
    out += [_summary(a, f) for f in a.formats]
    return "\n".join(out)


def _head(a: Analysis) -> list[str]:
    out = [
        (
            f"rollpatch analyze: {len(a.checkpoints)} checkpoints ({len(a.pairs)} "
            f"transitions), {a.params:,} parameters in {a.tensors} tensors, "
            f"scales={a.scales}, {a.seconds:.1f}s"
        )
    ]
    out += [f"  [{i}] {p}" for i, p in enumerate(a.checkpoints)]
    out.append(
        "served view: " + ", ".join(f"{f} {human_bytes(a.view_bytes[f])}" for f in a.formats)
    )
    out += [f"{f}: {n} of {a.tensors} tensors quantised" for f, n in a.quantised.items()]
    if a.skipped:
        names = sorted(a.skipped)
        shown = ", ".join(f"{n} ({a.skipped[n]})" for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        out.append(f"left out (not served): {shown}{more}")
    return out


def _steps(a: Analysis) -> list[str]:
    rows = []
    for p in a.pairs:
        for f in a.formats:
            s = p.formats[f]
            rows.append(
                [
                    f"{p.index}→{p.index + 1}",
                    f,
                    _pct(s.changed_frac),
                    human_bytes(s.patch_bytes),
                    _pct(ratio(s.patch_bytes, s.view_bytes)),
                    _num(ratio(8 * s.patch_bytes, s.bound_bits)),
                    _num(ratio(s.xor_bytes, s.patch_bytes), ".2f"),
                    human_bytes(s.xor_bytes),
                    f"{s.seconds:.1f}s",
                ]
            )
    for f in a.formats:
        t = a.totals(f)
        rows.append(
            [
                "mean",
                f,
                _pct(t["mean_changed_frac"]),
                human_bytes(t["mean_patch_bytes"]),
                _pct(t["mean_patch_frac_of_view"]),
                _num(t["patch_to_bound"]),
                _num(ratio(1, t["patch_to_xor"] or 0), ".2f"),
                human_bytes(t["mean_xor_zstd3_bytes"]),
                "",
            ]
        )
    out = _table(
        [
            "step",
            "format",
            "changed %",
            "patch",
            "% of view",
            "patch/bound",
            "xor/patch",
            "xor+zstd3",
            "time",
        ],
        rows,
        left=2,
    )
    out += [
        "changed %    served values (elements; 4-bit codes count one each) that differ",
        "patch        len(rollpatch.patch.encode(diff(old, new), old)), header included",
        ("patch/bound  patch bits / i.i.d. bound n*H(k/n) + k*H(d) (< 1: the context model wins)"),
        "xor/patch    how many times larger the XOR+zstd-3 baseline (Stitch, slime) is",
    ]
    return out


def _groups(a: Analysis, fmt: str) -> list[str]:
    present = [g for g in GROUPS if g in a.pairs[0].formats[fmt].groups]
    rows = []
    for p in a.pairs:
        s = p.formats[fmt]
        rows.append(
            [f"{p.index}→{p.index + 1}", _pct(s.changed_frac)]
            + [_pct(ratio(s.groups[g].changed, s.groups[g].elements)) for g in present]
        )
    first = a.pairs[0].formats[fmt]
    rows.append(
        ["elements %", "100"]
        + [_pct(ratio(first.groups[g].elements, first.elements), 2) for g in present]
    )
    payload = {g: sum(p.formats[fmt].groups[g].payload_bytes for p in a.pairs) for g in present}
    total = sum(payload.values())
    rows.append(["payload %", "100"] + [_pct(ratio(payload[g], total), 2) for g in present])
    return _table(["step", "all"] + [_GROUP_LABELS[g] for g in present], rows)


def _experts(a: Analysis, fmt: str) -> list[str]:
    rows = []
    for p in a.pairs:
        s = p.formats[fmt]
        ex = s.experts
        assert ex is not None  # every transition has the first one's layout
        q = ex.quantiles()
        r_el = sum(r.elements for r in ex.routers)
        r_ch = sum(r.changed for r in ex.routers)
        mlp = s.groups.get("mlp")
        rows.append(
            [f"{p.index}→{p.index + 1}", str(len(ex.experts))]
            + [_pct(q.get(f"q{round(100 * x)}")) for x in QUANTILES]
            + [
                _pct(ratio(r_ch, r_el)),
                _pct(ratio(mlp.changed, mlp.elements) if mlp else None),
            ]
        )
    heads = ["step", "experts", "min", "p10", "median", "p90", "max", "router", "dense mlp"]
    out = _table(heads, rows)
    whole = _summed([p.formats[fmt].experts for p in a.pairs])
    most, least = whole.extremes()
    show = lambda es: ", ".join(f"{e.label} {_pct(e.changed_frac, 2)}%" for e in es)
    out += [
        f"most changed over the run: {show(most)}",
        f"least changed over the run: {show(least)}",
        "min..max: quantiles over experts of the share of their values that changed (all",
        "of an expert's tensors together); router: the routers' values; dense mlp: MLPs",
        "that every token goes through (dense layers, shared experts), - if none.",
    ]
    return out


def _summed(steps: Sequence[ExpertStep | None]) -> ExpertStep:
    """One ExpertStep that sums the counts of several transitions."""
    acc: dict[tuple[int, int], list[int]] = {}
    racc: dict[tuple[int, int], list[int]] = {}
    for st in steps:
        assert st is not None
        for src, dst in ((st.experts, acc), (st.routers, racc)):
            for e in src:
                cell = dst.setdefault((e.layer, e.expert), [0, 0])
                cell[0] += e.elements
                cell[1] += e.changed
    return ExpertStep(
        tuple(ExpertRate(k[0], k[1], *v) for k, v in sorted(acc.items())),
        tuple(ExpertRate(k[0], k[1], *v) for k, v in sorted(racc.items())),
    )


def _gaps(a: Analysis) -> list[str]:
    grids = list(a.pairs[0].gaps)
    qs = list(a.pairs[0].gaps[grids[0]]["quantiles"])
    rows = []
    for p in a.pairs:
        for grid in grids:
            g = p.gaps[grid]
            measured = p.formats[grid].changed_frac if grid in p.formats else None
            rows.append(
                [f"{p.index}→{p.index + 1}", grid]
                + [_num(g["quantiles"][q], ".3g") for q in qs]
                + [
                    _num(g["max"], ".3g"),
                    str(g.get("from_zero", 0)),
                    _pct(g["frac_gt_half"], 2),
                    _pct(g["frac_gt_one"], 2),
                    _pct(g["expected_changed"]),
                    _pct(measured),
                ]
            )
    out = _table(
        ["step", "grid", *qs, "max", "from 0", "r>0.5 %", "r>1 %", "model chg %", "measured %"],
        rows,
        left=2,
    )
    out += [
        "r < 1 for most values: the update is smaller than the gap, so the served value",
        "moves only if the master sits within r of a rounding boundary: probability min(r, 1)",
        "when it sits uniformly in its cell. model chg % = mean(min(r, 1)); measured % = changed",
        "% of the format of that grid (- if not analysed). r > 0.5: updates that move even a",
        "value sitting exactly on the grid. Quantiles ±2% (histogram); max exact, over updates",
        "from a nonzero value: from 0 counts updates from a served ±0, whose gap is the smallest",
        "subnormal (r ~ 1e34 for 1e-6; counted in the shares and quantiles, not in max).",
    ]
    bad = [
        (p.index, max(int(g.get("nonfinite_skipped", 0)) for g in p.gaps.values())) for p in a.pairs
    ]
    for i, n in bad:  # only in the JSON before (an audit, session 40)
        if n:
            out.append(
                f"NaN/inf: {n:,} non-finite master values in transition {i}→{i + 1} (left out "
                'of r; the publisher refuses such a version unless nonfinite="allow")'
            )
    return out


def _lag(a: Analysis, fmt: str) -> list[str]:
    rows = []
    for pt in a.lags[fmt]:
        rows.append(
            [
                str(pt.k),
                _pct(ratio(pt.changed, pt.elements)),
                _pct(ratio(pt.steps_changed, pt.elements)),
                _num(ratio(pt.changed, pt.steps_changed)),
                human_bytes(pt.patch_bytes),
                human_bytes(pt.steps_patch_bytes),
                _num(ratio(pt.patch_bytes, pt.steps_patch_bytes)),
            ]
        )
    return _table(["k", "changed %", "k steps %", "ratio", "patch 0→k", "k patches", "ratio"], rows)


def _summary(a: Analysis, fmt: str) -> str:
    t = a.totals(fmt)
    lag = a.lags[fmt][-1]
    return (
        f"{fmt}: a transition changes {_pct(t['mean_changed_frac'])}% of served values on "
        f"average; rollpatch ships {human_bytes(t['mean_patch_bytes'])} per transition "
        f"({_pct(t['mean_patch_frac_of_view'])}% of the {human_bytes(t['view_bytes'])} "
        f"view, {_num(t['patch_to_bound'])}x the i.i.d. bound); XOR+zstd-3 would ship "
        f"{human_bytes(t['mean_xor_zstd3_bytes'])} "
        f"({_num(ratio(1, t['patch_to_xor'] or 0), '.2f')}x). A follower {lag.k} "
        f"version{'s' if lag.k != 1 else ''} behind needs {human_bytes(lag.patch_bytes)} as one patch, "
        f"{human_bytes(lag.steps_patch_bytes)} as a chain."
    )
