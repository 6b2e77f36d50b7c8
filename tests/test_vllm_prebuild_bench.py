"""bench/vllm_prebuild.py runs end to end under the vLLM venv (shapes scaled down): every copy
way is checked against the weight with its writes, and the table and JSON carry all three."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import run_bench


def test_vllm_prebuild_bench_prints_its_table(vllm_python: Path, tmp_path: Path) -> None:
    out = tmp_path / "prebuild.json"
    env = dict(os.environ, ROLLPATCH_VLLM_VENV=str(vllm_python.parent.parent))
    stdout = run_bench(
        "vllm_prebuild.py", "--scale", "64", "--rounds", "2", "--json", str(out), env=env
    )
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines[0].startswith("chg %") and "reused / 3 steps" in lines[0]
    assert [ln.split()[0] for ln in lines[2:4]] == ["2.7", "7.0"]
    data = json.loads(out.read_text())
    assert data["modules"] == 37 and [r["density"] for r in data["rows"]] == [0.027, 0.07]
    for r in data["rows"]:
        assert set(r["ms"]) == {"3 steps", "one pass", "reused"}
        assert all(len(v) == 2 for v in r["samples"].values())
    if data["onednn_unavailable"]:  # this CPU: vLLM builds no handler, and the table says so
        assert any("none built: vLLM's oneDNN BF16 matmul is not available" in ln for ln in lines)
        assert all(r["ms"][w]["handlers"] < 1 for r in data["rows"] for w in r["ms"])
