"""Sharded publishers against the failures of audit J (multi-rank gloo trainers).

Ranks run as threads of this process, joined by ``ThreadGroup`` (the same JSON round trip
as gloo's), except where gloo itself is what is tested. Each test names the audit finding.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.errors import BoardError, ConfigError
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct
from rollpatch.publisher.rounds import Snapshot, agree
from rollpatch.publisher.sharded import Exchange
from tests.conftest import free_port
from tests.pubfix import ScriptedPeer, run_ranks

RUN = "audit"
NAMES = [f"layers.{i}.w" for i in range(4)]
CFG = PublisherConfig(format="bf16", keyframe_every=50, skip_strides=())


@pytest.fixture
def board(memory_board: Board) -> Board:
    return memory_board


def masters(version: int) -> dict[str, np.ndarray]:
    base = np.random.default_rng(0)
    step = np.random.default_rng(100 + version)
    return {
        n: base.standard_normal((16, 32)).astype(np.float32)
        + (version * 2e-5 * step.standard_normal((16, 32))).astype(np.float32)
        for n in NAMES
    }


def shard(version: int, rank: int, owner: Callable[[int], int] = lambda i: i % 2) -> dict:
    return {n: a for i, (n, a) in enumerate(sorted(masters(version).items())) if owner(i) == rank}


# -- H4: ranks' shards of one version taken at different steps ----------------------------


def test_agree_refuses_a_version_whose_ranks_hold_different_steps() -> None:
    peer = ScriptedPeer({"pending": [3, 4], "steps": [4, 5], "closing": False, "keyframe": False})
    hand = [Snapshot(3, {}, 0.0, 0.0, 3)]
    with pytest.raises(BoardError, match="different training steps") as e:
        agree(peer, hand, closing=False, keyframe=False, sync=False)
    assert e.value.context["steps"] == {0: 3, 1: 4} and e.value.context["version"] == 3
    same = ScriptedPeer({"pending": [3], "steps": [3], "closing": False, "keyframe": False})
    assert agree(same, hand, closing=False, keyframe=False, sync=False).version == 3


def test_a_rank_one_step_ahead_publishes_nothing_of_the_version(board: Board) -> None:
    def body(rank: int, x: Exchange) -> Any:
        with Publisher(board, RUN, CFG, group=x, asynchronous=False) as pub:
            pub.publish(shard(0, rank), step=0)
            pub.publish(shard(1, rank), step=1 if rank == 0 else 2)  # rank 1 skipped a step

    out = run_ranks(body)
    for e in out:
        assert isinstance(e, BoardError) and "different training steps" in str(e)
        assert e.context["steps"] == {0: 1, 1: 2}
    assert board.versions(RUN) == [0] and board.latest(RUN).version == 0  # type: ignore[union-attr]


# -- H5: ranks given different PublisherConfig settings -------------------------------------


def test_ranks_with_different_settings_are_refused_before_anything_is_written(
    board: Board,
) -> None:
    def body(rank: int, x: Exchange) -> Any:
        cfg = PublisherConfig(
            format="fp16" if rank == 1 else "bf16",
            keyframe_every=10 if rank == 1 else 50,
            publisher_id=f"rank{rank}",  # per rank: never compared
            max_pending=1 + rank,
        )
        with Publisher(board, RUN, cfg, group=x, asynchronous=False) as pub:
            pub.publish(shard(0, rank))

    out = run_ranks(body)
    for e in out:
        assert isinstance(e, ConfigError), e
        assert "format, keyframe_every" in str(e)
        assert e.context["settings"] == {
            "format": {0: "bf16", 1: "fp16"},
            "keyframe_every": {0: 50, 1: 10},
        }
    assert board.versions(RUN) == [] and board.latest(RUN) is None


def test_shared_settings_leave_per_rank_fields_out() -> None:
    a = PublisherConfig(publisher_id="a", max_pending=1, diff_on="host", takeover=False)
    b = PublisherConfig(publisher_id="b", max_pending=5, diff_on="auto", takeover=True)
    assert a.shared_settings() == b.shared_settings()
    assert PublisherConfig(skip_strides=(4,)).shared_settings() != a.shared_settings()
    json.dumps(a.shared_settings())  # sent between ranks as JSON


# -- H2: an exception on one rank inside ``with Publisher(...)``, or interpreter exit -------


class Recording:
    """An exchange that counts the rounds its rank joins after aborting."""

    def __init__(self, x: Exchange) -> None:
        self.x, self.rank, self.size = x, x.rank, x.size
        self.aborted, self.after_abort = False, 0

    def allgather(self, message: Any) -> list[Any]:
        self.after_abort += self.aborted
        return self.x.allgather(message)

    def abort(self) -> None:
        self.aborted = True
        self.x.abort()  # type: ignore[attr-defined]


def test_an_exception_inside_with_aborts_the_rank_without_a_round(board: Board) -> None:
    def body(rank: int, x: Exchange) -> Any:
        rec = Recording(x)
        try:
            with Publisher(board, RUN, CFG, group=rec) as pub:
                pub.publish(shard(0, rank))
                pub.flush()
                if rank == 1:
                    raise KeyError("the trainer failed")  # rank 0 goes on to version 1
                pub.publish(shard(1, rank))
                with pytest.raises(BoardError, match="rank 1 aborted"):
                    pub.flush()
                return pub.last_durable
        except KeyError as e:
            assert pub._worker is not None
            pub._worker.join(10)  # it ended without joining a round
            return e, rec.aborted, rec.after_abort

    out = run_ranks(body, timeout_s=20)
    assert out[0] == 0
    assert isinstance(out[1][0], KeyError)  # the trainer's own error, not a publisher's
    assert out[1][1:] == (True, 0)
    assert board.versions(RUN) == [0] and board.latest(RUN).version == 0  # type: ignore[union-attr]


def test_a_sharded_publisher_open_at_an_exit_by_exception_is_aborted_not_flushed(
    board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpatch.publisher.exiting import end_at_exit

    # an uncaught exception ends the interpreter: sys.last_value is set before exit hooks
    monkeypatch.setattr(sys, "last_value", RuntimeError("the trainer failed"), raising=False)

    def body(rank: int, x: Exchange) -> Any:
        pub = Publisher(board, RUN, CFG, group=x)
        pub.publish(shard(0, rank))
        pub.flush()
        if rank == 1:
            end_at_exit(pub)  # interpreter exit: no round, no error
            return pub.stats.published
        pub.publish(shard(1, rank))
        with pytest.raises(BoardError, match="rank 1 aborted"):
            pub.flush()
        end_at_exit(pub)  # the error was raised: nothing more to say
        return pub.stats.published

    assert run_ranks(body, timeout_s=20) == [1, 1]
    assert board.versions(RUN) == [0]


# -- H2 and H6 over gloo: two processes, as torchrun starts them ------------------------------


def _gloo_rank(rank: int, port: int, board_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from rollpatch.publisher import sharded

    sharded.HANDSHAKE_S = 3.0
    report: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        _gloo_phases(rank, Path(board_dir).as_uri(), report)
    except BaseException:  # noqa: BLE001 (handed to the test)
        report["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # rank 0's publisher group timed out (phase 1): no goodbye


def _gloo_phases(rank: int, uri: str, report: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from rollpatch.errors import RollpatchError

    grads = torch.ones(1)
    t0 = time.monotonic()
    try:  # H2: rank 1's trainer fails inside the with; rank 0's waits in its gradient sync
        with Publisher(uri, "h2", CFG, collective_timeout_s=6.0) as pub:
            pub.publish(shard(0, rank))
            pub.flush()
            if rank == 1:
                t0 = time.monotonic()
                raise KeyError("the trainer failed")
            dist.all_reduce(grads)  # returns once rank 1's trainer gets there
            pub.publish(shard(1, rank))
            try:
                pub.flush()
                report["h2"] = "no error"
            except RollpatchError as e:
                report["h2"] = str(e)
    except KeyError:
        report["exit_s"] = time.monotonic() - t0
        dist.all_reduce(grads)  # the trainer handles its error, then syncs
    dist.barrier()
    # L3: publishers built again and again on one job (the rebuild recipe), closed or aborted,
    # leave no gloo group behind (before: one group, its threads and sockets, per rebuild)
    groups = dist.distributed_c10d._world.pg_map
    before = len(groups)
    for i in range(3):
        with Publisher(uri, "l3", CFG) as pub:
            pub.publish(shard(i, rank))
    Publisher(uri, "l3", CFG).abort()  # its worker frees the group on its way out
    deadline = time.monotonic() + 20
    while len(groups) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    report["l3"] = [before, len(groups)]
    if rank == 0:  # H6: a publisher on the main process only, as for a gathered state dict
        t0 = time.monotonic()
        try:
            Publisher(uri, "h6", CFG)
            report["h6"] = "constructed"
        except ConfigError as e:
            report["h6"], report["h6_s"] = str(e), time.monotonic() - t0
        with Publisher(uri, "h6", CFG, sharded=False) as pub:
            report["h6_v"] = pub.publish(shard(0, 0) | shard(0, 1))
    dist.barrier()


def test_gloo_ranks_abort_on_an_exception_and_refuse_a_one_rank_publisher(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    ctx = multiprocessing.get_context("spawn")
    args = (free_port(), str(tmp_path / "board"), str(out))
    procs = [ctx.Process(target=_gloo_rank, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 90
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rep in enumerate(reports):
        assert "crash" not in rep, f"rank {r}:\n{rep['crash']}"
    assert reports[1]["exit_s"] < 3  # aborted: no round with rank 0, blocked in all_reduce
    assert "publisher rank 1 aborted" in reports[0]["h2"]  # after collective_timeout_s
    assert "did not construct one within 3 s" in reports[0]["h6"]
    assert "sharded=False" in reports[0]["h6"] and reports[0]["h6_s"] < 30
    assert reports[0]["h6_v"] == 0
    board = Board(tmp_path.joinpath("board").as_uri())
    assert board.versions("h2") == [0] and board.versions("h6") == [0]
    for rep in reports:  # L3: every rebuilt publisher's group was destroyed
        before, after = rep["l3"]
        assert after <= before, rep["l3"]  # (H2's aborted group may go meanwhile)
    assert board.versions("l3") == [0, 1, 2]


# -- H1: the ranks' tensors change across sessions, at the same world size -------------------


def test_a_changed_assignment_of_tensors_to_ranks_resumes_on_the_whole_view(
    board: Board, caplog: pytest.LogCaptureFixture
) -> None:
    def session(versions: range, owner: Callable[[int], int]) -> list[Any]:
        def body(rank: int, x: Exchange) -> Any:
            with Publisher(board, RUN, CFG, group=x, asynchronous=False) as pub:
                for v in versions:
                    pub.publish(shard(v, rank, owner), v)
                return pub.resume_scope

        return run_ranks(body)

    dealt = lambda i: i % 2
    swapped = lambda i: 1 - i % 2
    assert session(range(2), dealt) == [None, None]
    assert session(range(2, 4), swapped) == ["whole", "whole"]  # other names: whole view
    caplog.set_level(logging.INFO, logger="rollpatch.publisher")
    # same names as the last session, but the path from keyframe 0 mixes both assignments
    assert session(range(4, 6), swapped) == ["whole", "whole"]
    assert "cannot be rebuilt from its own objects" in caplog.text
    assert session(range(6, 8), dealt) == ["whole", "whole"]
    for v in range(8):
        assert reconstruct(board, RUN, v).digest() == cast_view(masters(v), "bf16").digest()


# -- L1: the large-step warning of a sharded rank -------------------------------------------


def test_the_large_step_warning_speaks_of_the_rank_s_shard_and_skips_empty_ones(
    board: Board, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollpatch.publisher")

    def body(rank: int, x: Exchange) -> Any:
        with Publisher(board, RUN, CFG, group=x, asynchronous=False) as pub:
            for v in range(3):  # rank 1's shard is empty: its patch is a header only
                pub.publish(shard(v, rank, lambda i: 0), v)
        with Publisher(board, "other", CFG, group=x, asynchronous=False) as pub:
            pub.publish(shard(0, rank))
            pub.publish({k: -5 * a for k, a in shard(1, rank).items()})  # another model

    assert run_ranks(body) == [None, None]
    large = [r.getMessage() for r in caplog.records if "the step patch from" in r.getMessage()]
    assert len(large) == 2 and all(m.startswith("other@1:") for m in large), large
    assert all("of this rank's shard" in m for m in large), large


# -- M2: rank 0 knows its manifest and LATEST are durable when the outcome exchange fails ------


class DiesAt:
    """Rank 1's exchange: its ``n``-th exchange aborts the group (as its process dying)."""

    def __init__(self, x: Exchange, n: int) -> None:
        self.x, self.rank, self.size, self.n = x, x.rank, x.size, n

    def allgather(self, message: Any) -> list[Any]:
        self.n -= 1
        if self.n == 0:
            self.x.abort()  # type: ignore[attr-defined]
            raise SystemExit("rank 1 died")
        return self.x.allgather(message)


def test_rank_0_counts_a_version_durable_when_a_rank_dies_after_its_manifest(
    board: Board,
) -> None:
    def body(rank: int, x: Exchange) -> Any:
        # per version: agree, shard messages, outcome; before them, settings and resume
        pub = Publisher(board, RUN, CFG, group=DiesAt(x, 8) if rank else x, asynchronous=False)
        pub.publish(shard(0, rank))
        try:
            pub.publish(shard(1, rank))
        except BoardError as e:
            return str(e), pub.last_durable
        finally:
            pub.abort()

    out = run_ranks(body)
    assert isinstance(out[1], SystemExit)
    text, durable = out[0]
    assert "version 1 was written" in text and "LATEST names it" in text
    assert durable == 1 == board.latest(RUN).version  # type: ignore[union-attr]


def test_a_sharded_publisher_open_at_a_normal_exit_publishes_what_is_pending(
    board: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's exit hook joins the last round: the last version is not dropped."""
    from rollpatch.publisher.exiting import end_at_exit

    monkeypatch.delattr(sys, "last_value", raising=False)

    def body(rank: int, x: Exchange) -> Any:
        pub = Publisher(board, RUN, CFG, group=x)
        pub.publish(shard(0, rank))
        pub.publish(shard(1, rank))
        end_at_exit(pub)
        return pub.stats.published

    published = run_ranks(body, timeout_s=20)
    assert published[0] == published[1] >= 1  # (version 0 may be coalesced away)
    latest = Board(board.store).latest(RUN)
    assert latest is not None and latest.version == 1  # the last one was not dropped


# -- M1: a tied embedding and head under FSDP2 ------------------------------------------------


def _fsdp_tied_rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rollpatch.publisher.guards import engine_names

    dist.init_process_group("gloo", rank=rank, world_size=2)
    report: dict[str, Any] = {}
    try:

        class Tied(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed_tokens = torch.nn.Embedding(40, 16)
                self.lm_head = torch.nn.Linear(16, 40, bias=False)
                self.lm_head.weight = self.embed_tokens.weight  # as transformers ties them

            def forward(self, x: Any) -> Any:
                return self.lm_head(self.embed_tokens(x))

        model = Tied()
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        sd = model.state_dict()
        report["kinds"] = sorted({type(v).__name__ for v in sd.values()})
        kept, _, dropped = engine_names(sd)
        report["kept"], report["dropped"] = sorted(kept), dropped
    except BaseException:  # noqa: BLE001 (written to the report the test reads)
        report["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_a_tied_head_under_fsdp2_is_published_once(tmp_path: Path) -> None:
    """Audit J, M1 (session 42): DTensors were never compared, so under FSDP2 a tied
    ``lm_head.weight`` was published beside the embedding and engines refused the run."""
    pytest.importorskip("torch")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_fsdp_tied_rank, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
        if p.is_alive():
            p.kill()
    for r in range(2):
        rep = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "crash" not in rep, rep.get("crash")
        assert rep["kinds"] == ["DTensor"]
        assert rep["kept"] == ["embed_tokens.weight"] and rep["dropped"] == ["lm_head.weight"]
