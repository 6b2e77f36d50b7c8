"""bench/serving_load.py's analysis (bench/_load_windows.py) on arrivals whose answers are
known: steady streams, one stall laid over a window, and the null control."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _load_windows import Window, summarize

GAP = 0.01  # 10 ms between tokens on every stream


def _stream(t0: float, t1: float, stall: tuple[float, float] | None = None) -> list[float]:
    """Arrivals every GAP from t0 to t1; ``stall`` (at, seconds): the arrivals after ``at``
    come that much later."""
    out, t = [], t0
    while t < t1:
        out.append(t)
        t += GAP
    if stall is not None:
        at, extra = stall
        out = [x + extra if x > at else x for x in out]
    return out


def _row(rows: list[dict[str, float]], label: str) -> dict[str, float]:
    (row,) = [r for r in rows if r["window"] == label]
    return row


def test_steady_load_adds_nothing() -> None:
    streams = [_stream(0.0 + k * 0.001, 10.0) for k in range(4)]
    windows = [Window("idle", 1.0, 4.0), Window("stage", 5.0, 5.5, "in_place")]
    rows = summarize(streams, windows)
    assert [r["window"] for r in rows] == ["idle", "stage (in_place)"]
    idle, stage = _row(rows, "idle"), _row(rows, "stage (in_place)")
    assert idle["tok_s"] == pytest.approx(400, rel=0.02)  # 4 streams x 100 tokens/s
    assert stage["tok_s_vs_idle"] == pytest.approx(1.0, rel=0.05)
    assert stage["gap_p50_ms"] == pytest.approx(10, abs=0.01)
    assert stage["added_ms"] == pytest.approx(0, abs=0.01)
    assert stage["null_ms"] == pytest.approx(0, abs=0.01)
    assert math.isnan(idle["added_ms"]) and math.isnan(idle["null_ms"])
    assert stage["net_ms"] == pytest.approx(0, abs=0.01)


def test_no_idle_window_gives_nan_not_zero() -> None:
    streams = [_stream(0.0, 10.0, (5.0, 0.2))]
    (row,) = summarize(streams, [Window("commit", 5.0, 5.05, "in_place")])
    assert math.isnan(row["tok_s_vs_idle"]) and math.isnan(row["added_ms"])
    assert math.isnan(row["null_ms"]) and math.isnan(row["net_ms"])
    assert row["gap_max_ms"] == pytest.approx(210, abs=0.5)  # what needs no idle still counts
    (empty,) = summarize([], [Window("reload", 1.0, 2.0)])
    assert math.isnan(empty["gap_p50_ms"]) and math.isnan(empty["stall_ms"])


def test_a_stall_over_the_commit_is_its_added_time() -> None:
    # every stream stops for 200 ms at t = 5.0; the commit window is 5.0-5.05
    streams = [_stream(0.0, 10.0, (5.0, 0.2)) for _ in range(3)]
    windows = [Window("idle", 1.0, 4.0), Window("commit", 5.0, 5.05, "in_place")]
    commit = _row(summarize(streams, windows), "commit (in_place)")
    assert commit["added_ms"] == pytest.approx(200, abs=0.5)
    assert commit["stall_ms"] == pytest.approx(210, abs=0.5)  # one gap: 10 ms + the stall
    assert commit["gap_max_ms"] == pytest.approx(210, abs=0.5)
    assert commit["null_ms"] == pytest.approx(0, abs=0.01)  # the idle windows are steady
    assert commit["net_ms"] == pytest.approx(200, abs=0.5)
    assert commit["n"] == 1 and commit["mean_ms"] == pytest.approx(50)


def test_windows_of_one_label_pool() -> None:
    streams = [_stream(0.0, 20.0, (12.0, 0.1)), _stream(0.0, 20.0, (12.0, 0.1))]
    windows = [
        Window("idle", 1.0, 4.0),
        Window("reload", 6.0, 6.2),  # nothing happens here
        Window("reload", 12.0, 12.2),  # the 100 ms stall
    ]
    reload = _row(summarize(streams, windows), "reload")
    assert reload["n"] == 2
    assert reload["gap_max_ms"] == pytest.approx(110, abs=0.5)
    # (window, stream) pairs: two add 0, two add 100 ms: the median is between
    assert reload["added_ms"] == pytest.approx(50, abs=0.5)
