"""How many threads the native core's callers use: the cores the process may run on (vLLM's
CPU worker is pinned to the cores its OMP threads own), or ``ROLLPATCH_THREADS``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollpatch import native

PROBE = "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " + (
    "from rollpatch.native import threads; print(threads())"
)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_a_pinned_process_gets_one_thread_per_core_it_may_use() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROLLPATCH_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1"


def test_the_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPATCH_THREADS", "3")
    assert native.threads() == 3
    monkeypatch.setenv("ROLLPATCH_THREADS", "0")
    assert native.threads() == 1
    monkeypatch.delenv("ROLLPATCH_THREADS")
    assert 1 <= native.threads() <= (os.cpu_count() or 1)
