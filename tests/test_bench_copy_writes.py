"""bench/copy_writes.py runs end to end (shapes scaled down) and prints its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollpatch import native
from tests.conftest import run_bench


@pytest.mark.skipif(native.core is None, reason="the native core is not built")
def test_copy_writes_bench_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "cw.json"
    stdout = run_bench("copy_writes.py", "--scale", "64", "--repeats", "1", "--json", str(out))
    lines = stdout.splitlines()
    assert lines[0].startswith("shape (BF16)") and "one pass / 3 steps" in lines[0]
    assert len([ln for ln in lines if ln.startswith(("qkv", "o ", "gate_up", "down"))]) == 8
    rows = json.loads(out.read_text())["rows"]
    assert {r["density"] for r in rows} == {0.027, 0.07}
    assert all(r["ms"]["fresh"] > 0 and r["ms"]["three"] > 0 for r in rows)
