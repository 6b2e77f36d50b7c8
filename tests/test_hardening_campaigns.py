"""Short versions of the issue 11 campaigns (the long ones: ``python bench/fuzz_services.py``,
``python bench/soak.py --minutes 30``): coverage-guided fuzzing of every parser plus
schemathesis against the real services, with 0 crashes, hangs or tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="the dev extra installs atheris")
pytest.importorskip("schemathesis", reason="the dev extra installs schemathesis")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))


@pytest.mark.slow
def test_fuzz_services_short(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "fuzz_services.py"),
            "--seconds",
            "3",
            "--cases",
            "8",
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=BENCH,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    by = {(r["campaign"], r["target"]): r for r in rows}
    from _fuzz_targets import TARGET_NAMES  # type: ignore[import-not-found]

    for name in TARGET_NAMES:
        assert by[("atheris", name)]["inputs"] > 0, name
    for service in ("sidecar", "gateway", "relay"):
        assert by[("schemathesis", service)]["inputs"] > 0, service
    assert all(r["crashes"] == 0 and r["hangs"] == 0 for r in rows), rows
    assert sum(r["inputs"] for r in rows if r["campaign"] == "atheris") > 1000
