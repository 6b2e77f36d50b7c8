"""bench/vllm.py's several-size table (bench/_vllm_sizes.py): sizes parsed, each size's JSON
named, and the table computed from runs' JSONs (no vLLM needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _vllm_sizes import combine, parse_sizes, size_json


def test_parse_sizes() -> None:
    assert parse_sizes("512x4, 1024x8,2048x9") == [(512, 4), (1024, 8), (2048, 9)]
    for bad in ("512", "512x", "x4", "512*4", "512x4,"):
        with pytest.raises(ValueError, match="HIDDENxLAYERS"):
            parse_sizes(bad)


def test_size_json(tmp_path: Path) -> None:
    assert size_json("/r/run.json", 2048, 9, tmp_path) == Path("/r/run-h2048l9.json")
    assert size_json("/r/run", 512, 4, tmp_path) == Path("/r/run-h512l4.json")
    assert size_json(None, 512, 4, tmp_path) == tmp_path / "vllm-h512l4.json"


def _runs(pause_ms: list[float], vis_s: float | None = None, **extra: Any) -> list[dict[str, Any]]:
    out = []
    for p in pause_ms:
        r: dict[str, Any] = {"pause_s": p / 1e3, "phases_ms": {"core_ms": p / 2}, **extra}
        if vis_s is not None:
            r["visible_to_serving_s"] = vis_s
        out.append(r)
    return out


def _ctx(
    params: int, hidden: int, layers: int, scale: float, *, chain: bool = True
) -> dict[str, Any]:
    """A run's JSON with the keys the table reads: vLLM pauses of 10/20/30 ms x ``scale``
    against reloads of 1 s x ``scale``; built-in loads of 500 ms; ``chain``: the catch-ups
    from a non-anchor (absent from runs made before ``fold_every``)."""
    mem = {"staged_bytes": 4 << 20, "stage_memory_mib": {"decode_mib": 3.0, "prebuild_mib": 40.0}}
    s = scale
    ctx: dict[str, Any] = {
        "world": {
            "params": params,
            "dims": {"hidden_size": hidden, "layers": layers},
            "ckpt_bytes": [2 * params],
        },
        "catchup_n": 5,
        "load": (1.0, 2.5),
        "staged": _runs([10 * s, 20 * s, 30 * s], 1.0, **mem),
        "double": _runs([5 * s], 1.0),
        "catchup": _runs([25 * s], 3.0),
        "inline": _runs([400 * s]),
        "reloads": _runs([1000 * s, 1000 * s]),
        "reference": _runs([100.0], 0.5),
        "reference_double": _runs([2.0], 0.5),
        "reference_catchup": _runs([150.0], 1.5),
        "reference_loads": _runs([500.0]),
        "memory": {"start_kb": 2048 * 1024, "peak_kb": 50 * 1024, "double_peak_kb": 60 * 1024},
    }
    if chain:
        ctx["catchup_chain"] = _runs([30 * s], 4.5)
        ctx["reference_catchup_chain"] = _runs([160.0], 2.0)
    return ctx


def test_combine_orders_by_size_and_computes_ratios(tmp_path: Path) -> None:
    big, small = tmp_path / "big.json", tmp_path / "small.json"
    big.write_text(json.dumps(_ctx(441_000_000, 2048, 9, 2.0)))
    small.write_text(json.dumps(_ctx(16_000_000, 512, 4, 1.0, chain=False)))
    out = combine([str(big), str(small)])
    lines = out.splitlines()
    rows = [ln for ln in lines if "vLLM staged, 1 behind" in ln]
    assert rows[0].startswith("16M (512x4)") and rows[1].startswith("441M (2048x9)")
    # p50 20 ms, max 30 ms, engine hold 10 ms, visible->serving 1 s, 2.0% of the 1 s reload
    assert rows[0].split()[-5:] == ["20.0", "30.0", "10.0", "1000", "2.0%"]
    assert any("vLLM staged, 5 behind" in ln for ln in lines)
    chains = [ln for ln in lines if "5 behind, chain" in ln]
    assert len(chains) == 2 and all(ln.startswith("441M") for ln in chains)  # 16M has none
    small_row = next(
        ln for ln in lines if ln.startswith("16M") and "vLLM" not in ln and "built" not in ln
    )
    assert small_row.split()[6:10] == ["3.00x", "-", "3.00x", "-"]
    target = next(
        ln for ln in lines if ln.startswith("441M") and "vLLM" not in ln and "built-in" not in ln
    )
    cells = target.split()
    # in place 40/2000 ms = 2.0%; double 10/2000 = 0.5%; built-in 100/500 = 20.0%, 2/500 = 0.4%;
    # catch-up 3 s / 1 s = 3.00x, chain 4.5 / 1 = 4.50x, built-in 1.5 / 0.5 = 3.00x, chain
    # 2 / 0.5 = 4.00x; RSS 2048 MiB; peaks +50, +60;
    # the staging trace +3 and +40 MiB; 2 x the 4 MiB staged update = 8 MiB
    assert cells[2:] == [
        "2.0%",
        "0.5%",
        "20.0%",
        "0.4%",
        "3.00x",
        "4.50x",
        "3.00x",
        "4.00x",
        "2048",
        "841",
        "+50",
        "+60",
        "+3",
        "+40",
        "8",
    ]


def test_catch_up_ratios_divide_by_the_1_behind_timed_in_turn(tmp_path: Path) -> None:
    """A run that timed 1 behind in turn with the catch-ups divides by those samples, as the
    single-run report does (not by the staged path's, timed at another load)."""
    ctx = _ctx(441_000_000, 2048, 9, 2.0)
    ctx["catchup_one"] = _runs([20.0], 1.5)  # 3 s / 1.5 s
    ctx["reference_catchup_one"] = _runs([100.0], 0.75)  # 1.5 s / 0.75 s
    path = tmp_path / "run.json"
    path.write_text(json.dumps(ctx))
    row = next(
        ln
        for ln in combine([str(path)]).splitlines()
        if ln.startswith("441M") and "vLLM" not in ln and "built-in" not in ln
    )
    assert row.split()[6:10] == ["2.00x", "3.00x", "2.00x", "2.67x"]
