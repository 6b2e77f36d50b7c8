"""A sharded publisher rank dies mid-publish: the others fail fast, the board stays consistent.

Two gloo ranks on the CPU. Versions 0 and 1 publish normally; while version 2's objects are
uploading, rank 1's process exits (``os._exit``: no cleanup, as a crash or OOM kill). Rank 0
must raise a ``BoardError`` naming the lost rank well before gloo's default 30-minute timeout
(the join below gives it two minutes), and the board must still end at version 1: no manifest
for version 2, LATEST on 1, version 1 reconstructs bit for bit. A second pair has rank 1 hang
(alive, stuck in its upload) instead: rank 0 raises once ``collective_timeout_s`` is up.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.formats import cast_view
from rollpatch.publisher import reconstruct
from tests.conftest import free_port

RUN = "dies"
WORLD = 2
NAMES = [f"layers.{i}.w" for i in range(4)]


def full_masters(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {n: (rng.standard_normal((32, 64)) * 0.02).astype(np.float32) for n in NAMES}


def _rank_main(rank: int, port: int, board_dir: str, out_dir: str, hang: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.store import FileStore

    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    except RuntimeError as e:  # DistNetworkError: the port was taken between pick and bind
        if "EADDRINUSE" not in str(e):
            raise
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"port_taken": True}))
        os._exit(0)
    report: dict[str, Any] = {}
    dying = {"version": None}

    class DyingStore(FileStore):
        def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
            if rank == 1 and dying["version"] == 2 and "/objects/" in key:
                if hang:  # alive but stuck (a wedged upload): only a timeout can tell
                    time.sleep(600)
                os._exit(17)  # mid-publish: no cleanup, no goodbye to the other rank
            super()._put(key, data, if_absent=if_absent)

    board = Board(DyingStore(board_dir, fsync=False))
    cfg = PublisherConfig(format="bf16", keyframe_every=0, skip_strides=())
    try:
        pub = Publisher(board, RUN, cfg, collective_timeout_s=8.0 if hang else None)
        for v in range(3):
            dying["version"] = v
            shard = {
                n: torch.from_numpy(a)
                for i, (n, a) in enumerate(sorted(full_masters(v).items()))
                if i % WORLD == rank
            }
            pub.publish(shard)
            if v < 2:
                pub.flush()
        t = time.monotonic()
        try:
            pub.flush()
            report["flush"] = "no error"
        except Exception as e:  # noqa: BLE001 (reported to the test)
            report["flush"] = f"{type(e).__name__}: {e}"
        report["seconds"] = time.monotonic() - t
        try:
            pub.close()
        except Exception as e:  # noqa: BLE001
            report["close"] = f"{type(e).__name__}"
    except BaseException:  # noqa: BLE001 (written to the report the test reads)
        report["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # the group is broken: skip destroy_process_group


def _run_pair(tmp_path: Path, hang: bool) -> tuple[list[Any], Path, Path]:
    """Both ranks run; again on a new port (new board) when the rendezvous port was taken by
    another process between picking it and binding it (tests run side by side)."""
    for attempt in range(3):
        board_dir, out_dir = tmp_path / f"board{attempt}", tmp_path / f"out{attempt}"
        out_dir.mkdir()
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, port, str(board_dir), str(out_dir), hang))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        procs[0].join(timeout=120)
        rank0_stuck = procs[0].is_alive()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)
        assert not rank0_stuck, "rank 0 hung after its peer failed (no fail-fast)"
        taken = [
            json.loads(f.read_text()).get("port_taken", False) for f in out_dir.glob("rank*.json")
        ]
        if not any(taken):
            return procs, board_dir, out_dir
    raise AssertionError("the rendezvous port was taken three times in a row")


def test_a_rank_dying_mid_publish(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    procs, board_dir, out_dir = _run_pair(tmp_path, hang=False)
    assert procs[1].exitcode == 17
    report = json.loads((out_dir / "rank0.json").read_text())
    assert "crash" not in report, report.get("crash")
    assert report["flush"].startswith("BoardError"), report
    assert "rank" in report["flush"]
    b = Board(f"file://{board_dir}")
    assert b.versions(RUN) == [0, 1]
    assert b.latest(RUN).version == 1
    want = cast_view(full_masters(1), "bf16")
    assert reconstruct(b, RUN, 1).digest() == want.digest()


def test_a_hung_rank_times_out(tmp_path: Path) -> None:
    """Rank 1 stays alive but never answers: rank 0 raises once collective_timeout_s is up."""
    pytest.importorskip("torch")
    _, board_dir, out_dir = _run_pair(tmp_path, hang=True)
    report = json.loads((out_dir / "rank0.json").read_text())
    assert "crash" not in report, report.get("crash")
    assert report["flush"].startswith("BoardError"), report
    b = Board(f"file://{board_dir}")
    assert b.versions(RUN) == [0, 1] and b.latest(RUN).version == 1
