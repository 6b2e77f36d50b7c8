"""Sharded publishing: two gloo ranks on CPU, each holding half of the tensors.

One pair of spawned processes runs every phase (spawning and importing torch dominates the
cost): asynchronous publishing with keyframes and skip patches, a resume in synchronous mode,
coalescing with ranks whose uploads run at different speeds, an error on one rank, and an
explicit ``group=``. Resumes rebuild each rank's own shard only (``resume_scope``). The parent then reconstructs every version as a follower would and
compares it with the cast of the full, unsharded state dict.
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
from rollpatch.errors import BoardError
from rollpatch.formats import cast_view
from rollpatch.publisher import reconstruct
from rollpatch.publisher.rounds import Snapshot, agree
from tests.conftest import free_port
from tests.pubfix import ScriptedPeer

RUN = "sharded"
FORMAT = "fp8-e4m3"
WORLD = 2
NAMES = [f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(2) for p in ("up", "down")]
NAMES.append("model.norm.weight")


def full_masters(version: int) -> dict[str, np.ndarray]:
    """The trainer's whole state dict at ``version`` (deterministic)."""
    base = np.random.default_rng(0)
    step = np.random.default_rng(1000 + version)
    out = {}
    for name in NAMES:
        shape = (128,) if name.endswith("norm.weight") else (64, 128)
        w = base.standard_normal(shape).astype(np.float32) * 0.02
        out[name] = w + (version * 1e-4 * step.standard_normal(shape)).astype(np.float32)
    return out


def shard_of(masters: dict[str, np.ndarray], rank: int) -> dict[str, Any]:
    """This rank's tensors, as torch tensors (what an FSDP/TP rank would hold)."""
    import torch

    return {
        k: torch.from_numpy(v.copy())
        for i, (k, v) in enumerate(sorted(masters.items()))
        if i % WORLD == rank
    }


def _rank_main(rank: int, port: int, board_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    report: dict[str, Any] = {}
    try:
        _phases(rank, board_dir, report)
    except BaseException:
        report["crash"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def _phases(rank: int, board_dir: str, report: dict[str, Any]) -> None:
    from rollpatch.errors import RollpatchError
    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.store import FileStore

    class SlowFileStore(FileStore):
        def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
            time.sleep(0.002 if rank == 0 else 0.006)
            super()._put(key, data, if_absent=if_absent)

    uri = Path(board_dir).as_uri()
    cfg = PublisherConfig(format=FORMAT, keyframe_every=3, skip_strides=(2,), max_pending=100)
    with Publisher(uri, RUN, cfg) as pub:  # A: asynchronous, keyframes, skips
        assert (pub.rank, pub.shards) == (rank, WORLD)
        for v in range(7):
            assert pub.publish(shard_of(full_masters(v), rank)) == v
        pub.flush()
        report["A"] = [s.version for s in pub.stats.versions]
    with Publisher(uri, RUN, cfg, asynchronous=False) as pub:  # B: resume, synchronous
        assert pub.last_durable == 6
        for v in (7, 8):
            assert pub.publish(shard_of(full_masters(v), rank)) == v
        report["B"] = [s.version for s in pub.stats.versions]
        report["B_scope"] = pub.resume_scope  # rebuilt its own shard, not the whole view
    slow = Board(SlowFileStore(board_dir, fsync=False))
    coalesce = PublisherConfig(format=FORMAT, keyframe_every=0, skip_strides=(), max_pending=1)
    with Publisher(slow, RUN, coalesce) as pub:  # C: ranks coalesce at different paces
        pub.publish(shard_of(full_masters(9), rank))
        pub.flush()  # the resume (rebuilding version 8) is done
        for v in range(10, 21):
            pub.publish(shard_of(full_masters(v), rank))
            time.sleep(0.005 if rank == 0 else 0.02)  # rank 1's trainer lags behind
        pub.flush()
        report["C"] = [s.version for s in pub.stats.versions]
        report["C_scope"] = pub.resume_scope
        report["C_dropped"] = list(pub.stats.dropped)
    pub = Publisher(uri, RUN, cfg)  # D: rank 1 fails; every rank sees an error
    bad = shard_of(full_masters(21), rank)
    if rank == 1:
        next(iter(bad.values()))[0, 0] = float("nan")
    pub.publish(bad)
    try:
        pub.flush()
        report["D"] = "no error"
    except RollpatchError as e:
        report["D"] = f"{type(e).__name__}: {e}"
    pub.close()
    import torch.distributed as dist

    group = dist.new_group(ranks=[0, 1])  # E: an explicit group, synchronous
    with Publisher(uri, "grouped", cfg, group=group, asynchronous=False) as pub:
        report["E"] = [pub.publish(shard_of(full_masters(v), rank)) for v in range(2)]


def test_two_gloo_ranks_publish_shards(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    board_dir, out_dir = tmp_path / "board", tmp_path / "out"
    out_dir.mkdir()
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, str(board_dir), str(out_dir)))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, rep in enumerate(reports):
        assert "crash" not in rep, f"rank {r}:\n{rep['crash']}"
    assert all(p.exitcode == 0 for p in procs)

    assert reports[0]["A"] == reports[1]["A"] == list(range(7))
    assert reports[0]["B"] == reports[1]["B"] == [7, 8]
    # resumes rebuild each rank's own shard (its keyframe shard + its patch objects) only
    assert [r["B_scope"] for r in reports] == [r["C_scope"] for r in reports] == ["shard"] * 2
    assert reports[0]["C"] == reports[1]["C"], "ranks must publish the same versions"
    assert reports[0]["C"][-1] == 20
    assert "FormatError" in reports[1]["D"] and "NaN" in reports[1]["D"]
    assert "BoardError" in reports[0]["D"] and "rank 1" in reports[0]["D"]

    board = Board(board_dir.as_uri())
    published = board.versions(RUN)
    assert published == list(range(9)) + reports[0]["C"]
    assert board.latest(RUN).version == 20  # type: ignore[union-attr]
    assert board.keyframes(RUN) == [0, 3, 6]
    m4 = board.manifest(RUN, 4)
    assert m4.shards == 2 and {(p.base, p.shard) for p in m4.patches} == {
        (3, 0),
        (3, 1),
        (2, 0),
        (2, 1),
    }
    assert len(board.manifest(RUN, 6).keyframes) == 2
    for v in published:
        want = cast_view(full_masters(v), FORMAT)
        assert (
            reconstruct(board, RUN, v).digest() == want.digest() == board.manifest(RUN, v).target
        ), v
    assert [s.to for s in board.plan(RUN, 2, 8).steps] == [4, 6, 8]  # skip 6->8 after resume
    assert reports[0]["E"] == reports[1]["E"] == [0, 1]
    for v in (0, 1):
        assert (
            reconstruct(board, "grouped", v).digest() == cast_view(full_masters(v), FORMAT).digest()
        )


# -- the agreement rule, against a scripted peer ---------------------------------------------


def _hand(*versions: int) -> list[Snapshot]:
    return [Snapshot(v, {}, 0.0, 0.0, v) for v in versions]


def _peer(*pending: int, closing: bool = False, keyframe: bool = False) -> ScriptedPeer:
    return ScriptedPeer({"pending": list(pending), "closing": closing, "keyframe": keyframe})


@pytest.mark.parametrize(
    "mine,theirs,closing,expect",
    [
        ((8, 9), (9, 10), False, ("publish", 9)),  # oldest version both hold
        ((8,), (8,), False, ("publish", 8)),
        ((8,), (10,), False, ("wait", 10)),  # this rank must catch up to 10
        ((10,), (8,), False, ("wait", 10)),  # the peer must catch up; join again
        ((), (), True, ("exit", None)),
    ],
)
def test_agree(
    mine: tuple[int, ...], theirs: tuple[int, ...], closing: bool, expect: tuple[str, int | None]
) -> None:
    d = agree(
        _peer(*theirs, closing=closing), _hand(*mine), closing=closing, keyframe=False, sync=False
    )
    assert (d.action, d.version) == expect


def test_agree_keyframe_if_any_rank_asks() -> None:
    d = agree(_peer(3, keyframe=True), _hand(3), closing=False, keyframe=False, sync=False)
    assert d.keyframe and d.version == 3


@pytest.mark.parametrize(
    "mine,theirs,closing_peer,sync",
    [
        ((8,), (), True, False),  # the peer closed without ever publishing 8
        ((9,), (8,), True, False),  # the peer closed holding an older version only
        ((8,), (9,), False, True),  # synchronous ranks publishing different numbers
    ],
)
def test_agree_refuses_divergent_sequences(
    mine: tuple[int, ...], theirs: tuple[int, ...], closing_peer: bool, sync: bool
) -> None:
    with pytest.raises(BoardError, match="same version numbers"):
        agree(
            _peer(*theirs, closing=closing_peer),
            _hand(*mine),
            closing=False,
            keyframe=False,
            sync=sync,
        )
