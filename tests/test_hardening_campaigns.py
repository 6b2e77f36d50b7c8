"""Short versions of the issue 11 campaigns (the long ones: ``python bench/fuzz_services.py``,
``python bench/soak.py --minutes 30``): coverage-guided fuzzing of every parser plus
schemathesis against the real services, with 0 crashes, hangs or tracebacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="the dev extra installs atheris")
pytest.importorskip("schemathesis", reason="the dev extra installs schemathesis")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))


def _campaign(only: str, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(BENCH / "fuzz_services.py"),
            "--only",
            only,
            "--seconds",
            "3",
            "--cases",
            "8",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=BENCH,
        start_new_session=True,
    )


@pytest.mark.slow
def test_fuzz_services_short(tmp_path: Path) -> None:
    """bench/fuzz_services.py's two campaigns as two processes at once (atheris on one core,
    schemathesis against the services on the other; their work paths are disjoint): the same
    rows and checks as one ``fuzz_services.py`` run, in about the time of the longer one."""
    procs = {
        only: _campaign(only, tmp_path / f"{only}.json") for only in ("atheris", "schemathesis")
    }
    rows = []
    try:
        for only, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"{only}:\n{stdout[-4000:]}\n{stderr[-4000:]}"
            rows += json.loads((tmp_path / f"{only}.json").read_text())
    finally:  # a failed or hung campaign: the other one (and its children) goes too
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    by = {(r["campaign"], r["target"]): r for r in rows}
    from _fuzz_targets import TARGET_NAMES  # type: ignore[import-not-found]

    for name in TARGET_NAMES:
        assert by[("atheris", name)]["inputs"] > 0, name
    for service in ("sidecar", "gateway", "relay"):
        assert by[("schemathesis", service)]["inputs"] > 0, service
    assert all(r["crashes"] == 0 and r["hangs"] == 0 for r in rows), rows
    assert sum(r["inputs"] for r in rows if r["campaign"] == "atheris") > 1000
