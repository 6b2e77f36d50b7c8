"""Crash injection: kill -9 a publishing trainer anywhere; the board must stay consistent.

Every trial starts ``tests/crash_worker.py`` on the same file:// board (so each trial also
resumes from the previous crash), kills it with SIGKILL after a random delay — some during
start-up and resume, the rest while it publishes, half of them with random sleeps around every
store write so kills land inside and between the pipeline's stages — then checks the board
and publishes the next version with a fresh publisher.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollpatch.board import Board
from rollpatch.errors import ObjectIntegrityError
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, reconstruct
from rollpatch.store import FileStore
from tests.crash_worker import CONFIG, masters_for

RUN = "crashy"
WORKER = Path(__file__).with_name("crash_worker.py")
TRIALS = 50


def _kill_worker(board_dir: Path, rng: random.Random, trial: int, last: int | None) -> None:
    env = dict(os.environ, ROLLPATCH_CRASH_STAGE_SLEEP="0.01" if trial % 2 else "0")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(board_dir), RUN],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        if trial % 5 == 0:  # anywhere from interpreter start through resume
            time.sleep(rng.uniform(0.0, 0.6))
        else:
            assert proc.stdout is not None
            proc.stdout.readline()  # "ready" (or EOF if it died)
            if trial % 3 == 1:  # past at least one new version, however loaded the machine
                _until_latest_beyond(board_dir, last, proc)
            time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"worker died by itself:\n{err.decode()}"


def _until_latest_beyond(board_dir: Path, last: int | None, proc: subprocess.Popen) -> None:
    """Wait (at most 60 s, or until the worker exits) until LATEST is past ``last``."""
    board = Board(FileStore(board_dir))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        latest = board.latest(RUN)
        if latest is not None and (last is None or latest.version > last):
            return
        time.sleep(0.005)


def _check_board(board_dir: Path, verified: set[int]) -> tuple[int | None, bool]:
    """The invariants after a crash; returns (LATEST, whether a manifest is ahead of it)."""
    board = Board(FileStore(board_dir))
    latest = board.latest(RUN)
    versions = board.versions(RUN)
    ahead = [v for v in versions if latest is None or v > latest.version]
    assert len(ahead) <= 1, f"more than one manifest beyond LATEST: {ahead}"
    for v in versions:
        if v in verified:
            continue
        m = board.manifest(RUN, v)
        for ref in m.objects():
            board.fetch(ref)  # exists, right size, right BLAKE3
        verified.add(v)
    if latest is None:
        return None, bool(ahead)
    m = board.manifest(RUN, latest.version)
    assert m.target == latest.target
    assert {
        v for v in versions if board.manifest(RUN, v).is_keyframe and v <= latest.version
    } <= set(board.keyframes(RUN))
    view = reconstruct(board, RUN, latest.version)
    assert view.digest() == latest.target
    assert view.digest() == cast_view(masters_for(latest.version), "bf16").digest()
    return latest.version, bool(ahead)


def _resume_and_publish(board_dir: Path) -> int:
    board = Board(FileStore(board_dir))
    top = max(board.versions(RUN), default=None)
    with Publisher(board, RUN, CONFIG, asynchronous=False) as pub:
        assert pub.last_durable == top
        n = pub.publish(masters_for(0 if top is None else top + 1))
    assert n == (0 if top is None else top + 1)
    assert board.latest(RUN).version == n  # type: ignore[union-attr]
    assert reconstruct(board, RUN, n).digest() == cast_view(masters_for(n), "bf16").digest()
    return n


@pytest.mark.slow
def test_kill_9_anywhere_leaves_a_consistent_board(tmp_path: Path) -> None:
    board_dir = tmp_path / "board"
    rng = random.Random(20240601)
    verified: set[int] = set()
    ahead_seen = 0
    progress = []
    last = None
    for trial in range(TRIALS):
        _kill_worker(board_dir, rng, trial, last)
        latest, ahead = _check_board(board_dir, verified)
        ahead_seen += ahead
        progress.append((latest or -1) - (last if last is not None else -1))
        last = _resume_and_publish(board_dir)
    assert sum(p > 0 for p in progress) >= TRIALS // 5, "the workers hardly published"
    print(
        f"{TRIALS} kills: {len(verified)} versions verified, {ahead_seen} rolled forward, "
        f"{sum(p > 0 for p in progress)} trials published"
    )


def test_corrupt_or_truncated_objects_are_refused(tmp_path: Path) -> None:
    """A corrupt object is never used: the rebuild (and a resuming publisher) goes around it
    when another path exists, and refuses when none does."""
    board_dir = tmp_path / "board"
    board = Board(FileStore(board_dir, fsync=False))
    with Publisher(board, RUN, CONFIG, asynchronous=False) as pub:
        for n in range(3):
            pub.publish(masters_for(n))
    patch = board.plan(RUN, None, 2).steps[-1].objects[0]  # the skip patch 0 -> 2
    keyframe = board.manifest(RUN, 0).keyframes[0].ref
    path = board_dir / patch.key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ObjectIntegrityError, match="corrupt or truncated"):
        board.fetch(patch)
    # around it: 0 -> 1 -> 2, bit-exact
    assert reconstruct(board, RUN, 2).digest() == cast_view(masters_for(2), "bf16").digest()
    pub = Publisher(board, RUN, CONFIG)
    pub.publish(masters_for(3))
    pub.flush()  # resuming goes around it too
    assert pub.resume_scope == "whole" and board.manifest(RUN, 3).parent == 2
    pub.close()
    assert reconstruct(board, RUN, 3).digest() == cast_view(masters_for(3), "bf16").digest()
    kpath = board_dir / keyframe.key
    kpath.write_bytes(kpath.read_bytes()[:-100])
    with pytest.raises(ObjectIntegrityError, match="corrupt or truncated"):  # no way around
        reconstruct(board, RUN, 1)
    assert board.versions(RUN) == [0, 1, 2, 3]
