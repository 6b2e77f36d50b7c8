"""bench/peers.py checks every requested method's packages before it runs anything: a missing
one is one line naming the install, in about a second, instead of a raw ModuleNotFoundError
after the versions were prepared and other methods ran."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

#: Runs bench/peers.py with some packages made unimportable in that process only
#: (``sys.modules[name] = None``: ``import`` and ``find_spec`` then fail as if uninstalled).
_RUN = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
sys.argv = ["peers.py", *sys.argv[2:]]
sys.path.insert(0, {bench!r})
runpy.run_path({script!r}, run_name="__main__")
"""


def _peers(hidden: str, *args: str, work: Path) -> subprocess.CompletedProcess[str]:
    code = _RUN.format(bench=str(BENCH), script=str(BENCH / "peers.py"))
    return subprocess.run(
        [sys.executable, "-c", code, hidden, "--work", str(work), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_missing_shardcast_is_one_line_before_anything_runs(tmp_path: Path) -> None:
    work = tmp_path / "work"
    t0 = time.monotonic()
    r = _peers("shardcast", "--params", "1M", "--versions", "1", work=work)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "shardcast needs shardcast" in lines[0]
    assert "pip install -e '.[bench]'" in lines[0]
    assert "Traceback" not in r.stderr
    assert not work.exists()  # no versions prepared, no method run
    assert took < 60


def test_each_missing_package_is_named_with_its_install(tmp_path: Path) -> None:
    r = _peers(
        "xxhash,torch",
        "--methods",
        "rollpatch,xor",
        "--trainer-cast",
        "torch",
        work=tmp_path / "w",
    )
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "xor needs xxhash (pip install -e '.[web,dev]')" in line
    assert "--trainer-cast torch needs torch" in line
    assert "rollpatch needs" not in line  # its packages are installed


def test_a_method_not_requested_is_not_required(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(BENCH))
    from _peers_needs import missing

    monkeypatch.setitem(sys.modules, "shardcast", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "xxhash", None)
    assert missing(["rollpatch"], torch=False) is None
    line = missing(["rollpatch", "shardcast"], torch=False)
    assert line is not None and "shardcast needs shardcast" in line and "xor" not in line
