"""bench/vllm_queue.py's parts that need no vLLM: the gauges read from a metrics page, and the
table computed from samples."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _util import machine
from vllm_queue import parse_gauges, report

PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 797.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 797.0
"""


def test_gauges_sum_each_engine_and_skip_other_metrics() -> None:
    assert parse_gauges(PAGE) == {"waiting": 797.0, "running": 3.0}
    assert parse_gauges("") == {"waiting": 0.0, "running": 0.0}


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
