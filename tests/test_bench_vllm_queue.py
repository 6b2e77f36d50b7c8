"""bench/vllm_queue.py's part that needs no vLLM: the table computed from samples."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _util import machine
from vllm_queue import report


def test_report_one_row_per_queue_length() -> None:
    samples = [
        {"queue": q, "waiting": w, "hold_ms": h, "pause_s": p}
        for q, w, h, p in [
            (0, 0, 3.0, 0.012),
            (0, 0, 3.4, 0.014),
            (0, 0, 2.8, 0.013),
            (800, 800, 21.6, 0.028),
            (800, 790, 37.0, 0.050),
            (800, 796, 14.9, 0.021),
        ]
    ]
    args = {"queue": "0,800", "hidden": 512, "layers": 4, "prompt_tokens": 448}
    text = report({"args": args, "samples": samples}, machine())
    rows = [ln.split() for ln in text.splitlines()[4:6]]
    assert rows == [
        ["0", "0", "3", "3.0", "3.4", "13.0", "14.0"],
        ["800", "796", "3", "21.6", "37.0", "28.0", "50.0"],
    ]
