"""bench/join.py runs end to end (a small model) and prints its table: an engine booted from a
published version is adopted (only patches fetched, or nothing when it booted from LATEST)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_bench

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_join_bench_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "join.json"
    args = ["--hidden", "128", "--layers", "1", "--versions", "2", "--repeats", "1"]
    stdout = run_bench("join.py", *args, "--json", str(out))
    lines = stdout.splitlines()
    assert lines[0].startswith("elastic join to v2:")
    assert any("booted v0, boot=keyframe" in ln and "keyframe v0 + 2 patches" in ln for ln in lines)
    assert any("booted v0, boot=adopt" in ln and "2 patches from v0" in ln for ln in lines)
    assert any("booted v2, boot=adopt" in ln and "nothing to fetch" in ln for ln in lines)
    runs = {(r["booted"], r["boot"]): r for r in json.loads(out.read_text())["runs"]}
    assert runs[(2, "adopt")]["bytes"] == 0 and runs[(2, "adopt")]["adopted"] == 1
    assert runs[(0, "adopt")]["bytes"] < runs[(0, "keyframe")]["bytes"]
    assert runs[(0, "keyframe")]["adopted"] == 0
