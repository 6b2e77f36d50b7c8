"""FSDP2 ranks publish their DTensor shards without a gather (issue 14).

Two gloo ranks on the CPU train a small model wrapped with ``fully_shard`` (parameters are
``DTensor`` shards along dim 0, rows split unevenly, so some slices straddle 8-byte words)
and publish ``model.state_dict()`` as it is after every optimizer step:

- A: asynchronous publishing with keyframes and skip patches;
- B: a new publisher resumes the run from each rank's own slices (``resume_scope == "shard"``);
- C: rank 1's process exits while version 7's objects upload: rank 0 raises ``BoardError`` at
  once and the board stays at version 6.

Only for checking, both ranks gather each version's full state dict (``full_tensor``) and
rank 0 records the digest an unsharded publisher would write. The parent then requires every
manifest to name that digest, and a follower to reach every version bit for bit by patching
the view it holds in place.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from rollpatch.board import Board
from rollpatch.engines.view_engine import ViewEngine
from rollpatch.follower import Follower
from rollpatch.publisher import reconstruct
from tests.conftest import free_port

RUN = "fsdp"
WORLD = 2


def _rank_main(rank: int, port: int, board_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    report: dict[str, Any] = {"digests": {}}
    try:
        _phases(rank, board_dir, report)
    except BaseException:  # noqa: BLE001 (written to the report the test reads)
        report["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # after phase C the group is broken: skip destroy_process_group


def _phases(rank: int, board_dir: str, report: dict[str, Any]) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rollpatch.formats import cast_view
    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.store import FileStore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 37), torch.nn.Tanh(), torch.nn.Linear(37, 29))
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    report["placements"] = sorted(
        {str(v.placements) for v in model.state_dict().values()}  # type: ignore[attr-defined]
    )
    dying = {"version": -1}

    class DyingStore(FileStore):
        def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
            if rank == 1 and dying["version"] == 7 and "/objects/" in key:
                os._exit(17)  # mid-publish: no cleanup, no goodbye to the other rank
            super()._put(key, data, if_absent=if_absent)

    board = Board(DyingStore(board_dir, fsync=False))

    def step(v: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(v)
        x = torch.randn(32, 64, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sd = model.state_dict()
        full = {k: t.full_tensor().detach().numpy() for k, t in sd.items()}  # checking only
        if rank == 0:
            report["digests"][str(v)] = cast_view(full, "bf16").digest()
        return sd

    cfg = PublisherConfig(format="bf16", keyframe_every=3, skip_strides=(2,))
    with Publisher(board, RUN, cfg) as pub:  # A: asynchronous
        for v in range(4):
            pub.publish(step(v))
            pub.flush()
        report["A"] = [s.version for s in pub.stats.versions]
    with Publisher(board, RUN, cfg, asynchronous=False) as pub:  # B: resume
        for v in range(4, 6):
            pub.publish(step(v))
        report["B"] = [s.version for s in pub.stats.versions]
        report["B_scope"] = pub.resume_scope
    pub = Publisher(board, RUN, cfg, asynchronous=False)  # C: rank 1 dies in version 7
    for v in range(6, 8):
        dying["version"] = v
        sd = step(v)
        t = time.monotonic()
        try:
            pub.publish(sd)
        except Exception as e:  # noqa: BLE001 (reported to the test)
            report["C"] = f"{type(e).__name__}: {e}"
            report["C_seconds"] = time.monotonic() - t
            break


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("fsdp")
    board_dir, out_dir = tmp / "board", tmp / "out"
    out_dir.mkdir()
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, str(board_dir), str(out_dir)))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    procs[0].join(timeout=180)
    rank0_stuck = procs[0].is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=30)
    assert not rank0_stuck, "rank 0 hung after its peer died (no fail-fast)"
    assert procs[1].exitcode == 17, "rank 1 should have died in version 7"
    report = json.loads((out_dir / "rank0.json").read_text())
    assert "crash" not in report, report.get("crash")
    return board_dir, [report]


def test_fsdp_shards_publish_without_a_gather(fsdp_run: tuple[Path, list[dict]]) -> None:
    board_dir, (report,) = fsdp_run
    assert report["placements"] == ["(Shard(dim=0),)"]
    assert report["A"] == [0, 1, 2, 3] and report["B"] == [4, 5]
    assert report["B_scope"] == "shard"  # resumed from its own slices, not the whole view
    b = Board(board_dir.as_uri())
    assert b.versions(RUN) == list(range(7)) and b.latest(RUN).version == 6  # type: ignore[union-attr]
    for v in range(7):
        m = b.manifest(RUN, v)
        assert m.target == report["digests"][str(v)], v  # = an unsharded publish of the model
        assert m.shards == 2 and {t.name for t in m.sliced} == {
            "0.weight",
            "0.bias",
            "2.weight",
            "2.bias",
        }
    rows = {
        t.name: [(e.shard, e.offset, e.shape) for e in t.slices] for t in b.manifest(RUN, 6).sliced
    }
    assert rows["2.weight"] == [(0, 0, (15, 37)), (1, 555, (14, 37))]  # 1110 B: a shared word
    assert b.keyframes(RUN) == [0, 3, 6]


def test_a_rank_dying_mid_publish_fails_fast(fsdp_run: tuple[Path, list[dict]]) -> None:
    board_dir, (report,) = fsdp_run
    assert report["C"].startswith("BoardError") and "rank" in report["C"], report["C"]
    assert report["C_seconds"] < 60  # not gloo's 30-minute timeout
    b = Board(board_dir.as_uri())
    assert 7 not in b.versions(RUN)
    assert reconstruct(b, RUN, 6).digest() == report["digests"]["6"]


def test_followers_patch_fsdp_versions_in_place(fsdp_run: tuple[Path, list[dict]]) -> None:
    board_dir, (report,) = fsdp_run
    b = Board(board_dir.as_uri())
    f = Follower(b, RUN, ViewEngine())
    f.sync(0)
    held = f.engine.words()
    for v in range(1, 7):
        assert f.sync(v) == v
        assert f.engine.words() is held  # patched in place, never re-assembled
        assert held.digest() == report["digests"][str(v)]
    assert f.status().commits == 7
