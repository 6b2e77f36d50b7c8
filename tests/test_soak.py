"""The soak with faults, CI size (2 minutes of load; ``python bench/soak.py --minutes 30`` is
the long one): a fleet of processes under 64 concurrent clients, paced to 4 requests/s in all
(~480 requests: as a closed loop the soak took whatever CPU the other CI jobs left it, 176-312
s), while a version is published every second, through a relay restart, a store outage, a
forged manifest, corrupted objects (and the publisher restarted over them) and kill -9 of a
sidecar and of the publisher. Every answer is re-generated under the version it was labelled
with: 0 wrong-version and 0 unacceptable answers, and recovery from every fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3server import moto_available

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")
pytest.importorskip("boto3", reason="the s3 extra installs boto3")

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
@pytest.mark.skipif(not moto_available(), reason="the dev extra installs moto[server]")
def test_soak_with_faults_ci_size(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "soak.py"),
            "--seconds",
            "120",
            "--rate",
            "4",
            "--workdir",
            str(tmp_path / "soak"),
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=BENCH,
    )
    if not out.exists():  # the soak died before its report: say why, not FileNotFoundError
        pytest.fail(
            f"bench/soak.py exited {proc.returncode} without a report\n"
            f"stdout (end):\n{proc.stdout[-3000:]}\nstderr (end):\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["served"] > 0 and s["versions_checked"] > 1
    assert s["wrong_version"] == 0 and s["unacceptable"] == 0 and s["other"] == 0
    faults = {f["fault"]: f for f in report["faults"]}
    assert set(faults) == {
        "relay-restart",
        "store-outage",
        "forged",
        "corrupt",
        "sidecar-kill",
        "publisher-kill",
    }
    # every fault, the corrupted objects included: island b reads through the relay, which
    # answers them 409 object_corrupt, so its follower plans around them (docs/store.md)
    assert all(f["recovery_s"] is not None for f in faults.values()), (faults, proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
