"""Concurrent writers on every backend: threads racing put-if-absent, and separate processes
racing put-if-absent and compare-and-swap on one file store without a lost update.
"""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any

from rollpatch.errors import AlreadyExistsError, ConflictError
from rollpatch.store import FileStore, Store
from tests.conftest_s3 import store

_FIXTURES = (store,)  # used by name in the tests below (s3_server: tests/conftest.py)


# -- concurrency ------------------------------------------------------------------------------


def test_threads_race_put_if_absent(store: Store) -> None:
    winners: list[int] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            store.put("race", str(i).encode())
            winners.append(i)
        except AlreadyExistsError:
            pass

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and store.get("race") == str(winners[0]).encode()


def _race_put(root: str, n_keys: int, worker: int, barrier: Any, out: Any) -> None:
    s = FileStore(root)
    barrier.wait()
    won = []
    for k in range(n_keys):
        try:
            s.put(f"d{k}/e/obj", f"{worker}".encode() * 1000)  # folders race too
            won.append(k)
        except AlreadyExistsError:
            pass
    out.put((worker, won))


def _race_cas(root: str, rounds: int, worker: int, barrier: Any, out: Any) -> None:
    s = FileStore(root)
    barrier.wait()
    seen = []
    for _ in range(rounds):
        while True:
            cur = s.get("counter")
            try:
                s.cas("counter", str(int(cur) + 1).encode(), expected=cur)
                seen.append(int(cur))
                break
            except ConflictError:
                continue
    out.put((worker, seen))


def _worker(body: str, root: str, arg: int, worker: int, barrier: Any, out: Any) -> None:
    """Process entry point: run ``_race_<body>``; on failure send the traceback instead."""
    try:
        {"put": _race_put, "cas": _race_cas}[body](root, arg, worker, barrier, out)
    except BaseException:  # noqa: BLE001 (the parent fails the test with this traceback)
        import traceback

        out.put((worker, traceback.format_exc()))


def _run_procs(body: str, root: Path, n: int, arg: int) -> list[tuple[int, list[int]]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(body, str(root), arg, i, barrier, out)) for i in range(n)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    failures = [r for _, r in results if isinstance(r, str)]
    assert not failures, failures[0]
    return results


def test_file_processes_race_put_if_absent(tmp_path: Path) -> None:
    """8 processes publish the same 40 keys, each in folders nobody created yet: each key has
    exactly one winner, whose bytes stay, and no process trips over another's new folders."""
    results = _run_procs("put", tmp_path / "st", 8, 40)
    s = FileStore(tmp_path / "st")
    for k in range(40):
        owners = [w for w, won in results if k in won]
        assert len(owners) == 1, (k, owners)
        assert s.get(f"d{k}/e/obj") == f"{owners[0]}".encode() * 1000
    assert len(s.list()) == 40
    assert not any(".rp-tmp" in p.name for p in (tmp_path / "st").rglob("*"))


def test_file_processes_race_cas_no_lost_update(tmp_path: Path) -> None:
    """4 processes increment one counter 25 times each through cas: the total is exact."""
    FileStore(tmp_path / "st").cas("counter", b"0", expected=None)
    results = _run_procs("cas", tmp_path / "st", 4, 25)
    assert FileStore(tmp_path / "st").get("counter") == b"100"
    transitions = sorted(v for _, seen in results for v in seen)
    assert transitions == list(range(100))  # every old value was swapped out exactly once
