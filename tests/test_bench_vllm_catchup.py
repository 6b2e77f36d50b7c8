"""bench/vllm.py's catch-up plans (bench/_vllm_catchup.py) run on a small model without vLLM:
every plan stages through the engine's in-place decoder, and the decode is timed by part."""

from __future__ import annotations

import sys
from pathlib import Path

from rollpatch.formats import cast_view
from rollpatch.io import save_view
from rollpatch.patch import diff, encode, inspect
from tests.conftest import masters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _vllm_catchup import catchup_plans, render_plans


def test_catchup_plans_stage_every_plan_and_time_the_parts(tmp_path: Path) -> None:
    k = 3
    views = [cast_view(masters(v, 3e-4 * v), "bf16") for v in range(k + 1)]
    for v, view in enumerate(views):
        (tmp_path / f"v{v}").mkdir()
        save_view(view, tmp_path / f"v{v}" / "model.safetensors")
    blobs = {v: encode(diff(views[v - 1], views[v]), views[v - 1]) for v in range(1, k + 1)}
    res = catchup_plans(
        lambda v: tmp_path / f"v{v}",
        [view.digest() for view in views],
        blobs.__getitem__,
        k,
        reps=1,
    )
    assert res["k"] == k and res["words"] == sum(t.n_elements for t in views[0].values())
    plans = res["plans"]
    assert plans[f"{k} steps"]["patches"] == k and plans["1 behind"]["patches"] == 1
    assert plans[f"{k} steps"]["records"] > plans["1 behind"]["records"] > 0
    steps = res["parts"][f"{k} steps"]["steps"]
    assert [s["records"] for s in steps] == [
        sum(e["changed"] for e in inspect(blobs[v]).tensors) for v in range(1, k + 1)
    ]
    assert "1 behind" in render_plans(res)
