"""The publisher: versions reconstruct bit-exactly, formats, cadence, skips, coalescing,
snapshots of torch state dicts, signing, and ``publish``/``status`` on the command line.

Errors, configuration and resume: test_publisher_errors.py; helpers: tests/pubfix.py.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board, version_key
from rollpatch.cli import main
from rollpatch.errors import ConfigError, ManifestError
from rollpatch.formats import cast_view
from rollpatch.io import save_view
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct
from rollpatch.sim import AdamSim, SimConfig
from rollpatch.store import MemoryStore
from rollpatch.view import Tensor, View
from tests.pubfix import RUN, SlowStore, board, check_all, copy_masters, nudge, random_masters

_FIXTURES = (board,)  # used by name


# -- publishing and reconstructing -----------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [True, False])
@pytest.mark.parametrize("uri", ["memory", "file"])
def test_versions_reconstruct_bit_exact(tmp_path: Path, asynchronous: bool, uri: str) -> None:
    target = f"memory://pub-{uuid.uuid4().hex[:12]}" if uri == "memory" else tmp_path.as_uri()
    sim = AdamSim(SimConfig(n_params=100_000, lr=1e-5, seed=1, vocab=256))
    cfg = PublisherConfig(keyframe_every=4, skip_strides=(2, 4), max_pending=100)
    expected = {}
    with Publisher(target, RUN, cfg, asynchronous=asynchronous) as pub:
        for i in range(9):
            n = pub.publish(sim.masters())
            assert n == i
            expected[n] = copy_masters(sim.masters())
            sim.step()
        pub.flush()
        assert pub.last_durable == 8
        stats = pub.stats
    board = Board(target)
    assert board.versions(RUN) == list(range(9))
    assert board.latest(RUN).version == 8  # type: ignore[union-attr]
    assert board.keyframes(RUN) == [0, 4, 8]
    assert stats.published == 9 and stats.dropped == () and len(stats.versions) == 9
    assert stats.bytes_uploaded == sum(s.bytes for s in stats.versions) > 0
    for s in stats.versions:
        assert s.total_s >= s.cast_s + s.encode_s + s.upload_s
        assert 0 <= s.snapshot_s <= s.call_return_s
    check_all(board, expected)
    m4, m8 = board.manifest(RUN, 4), board.manifest(RUN, 8)
    assert {p.base for p in m4.patches} == {0, 2, 3}
    assert {p.base for p in m8.patches} == {4, 6, 7}
    assert m8.meta == {"step": "8", "scales": "bf16"}
    plan = board.plan(RUN, 0, 8)
    assert [(s.base, s.to) for s in plan.steps] == [(0, 4), (4, 8)]
    assert [(s.base, s.to) for s in board.plan(RUN, 1, 6).steps] == [(1, 2), (2, 4), (4, 6)]
    assert [(s.base, s.to) for s in board.plan(RUN, None, 6).steps] == [(None, 4), (4, 6)]


def test_every_published_version_is_one_event_line(caplog: pytest.LogCaptureFixture) -> None:
    """A trainer's log says each version once, when LATEST names it, with what it cost."""
    sim = AdamSim(SimConfig(n_params=100_000, lr=1e-5, seed=2, vocab=256))
    cfg = PublisherConfig(keyframe_every=4, skip_strides=(2,))
    with (
        caplog.at_level("INFO", logger="rollpatch.publisher"),
        Publisher(f"memory://pub-{uuid.uuid4().hex[:12]}", RUN, cfg, asynchronous=False) as pub,
    ):
        for _ in range(3):
            pub.publish(sim.masters())
            sim.step()
        stats = pub.stats
    said = [
        getattr(r, "rp_fields", {})
        for r in caplog.records
        if getattr(r, "rp_event", None) == "version_published"
    ]
    assert [f["version"] for f in said] == [0, 1, 2]
    assert [f["parent"] for f in said] == [None, 0, 1]
    assert [f["keyframe"] for f in said] == [True, False, False]
    assert [f["skip_bases"] for f in said] == [None, None, "0"]
    for f, s in zip(said, stats.versions, strict=True):
        assert (f["patch_bytes"], f["bytes"], f["changed"]) == (s.patch_bytes, s.bytes, s.changed)
        assert f["total_s"] == round(s.total_s, 3) and f["run"] == RUN


def test_quantised_format_and_meta(board: Board) -> None:
    masters = random_masters(0)
    cfg = PublisherConfig(format="fp8-e4m3", scales="bf16", keyframe_every=0)
    expected = {}
    with Publisher(board, RUN, cfg, asynchronous=False) as pub:
        for i in range(4):
            expected[pub.publish(masters, step=100 + i)] = copy_masters(masters)
            nudge(masters, i, lr=3e-3)
    assert board.keyframes(RUN) == [0]
    assert board.manifest(RUN, 2).meta["step"] == "102"
    assert board.manifest(RUN, 2).format == "fp8-e4m3"
    check_all(board, expected, "fp8-e4m3")


def test_keyframe_cadence_and_publish_keyframe(board: Board) -> None:
    masters = random_masters(1, n=1)
    with Publisher(
        board, RUN, PublisherConfig(keyframe_every=0, skip_strides=()), asynchronous=False
    ) as pub:
        for i in range(3):
            if i == 2:
                pub.publish_keyframe()
            pub.publish(masters)
            nudge(masters, i)
        pub.publish(masters, version=10)  # explicit numbers may jump
        assert pub.publish(masters) == 11
        with pytest.raises(ConfigError, match="increase"):
            pub.publish(masters, version=11)
    assert board.keyframes(RUN) == [0, 2]
    assert board.versions(RUN) == [0, 1, 2, 10, 11]
    assert board.manifest(RUN, 10).parent == 2
    with Publisher(
        board, "r2", PublisherConfig(keyframe_every=5, skip_strides=()), asynchronous=False
    ) as pub:
        for n in (3, 4, 6, 9, 10, 12):  # a keyframe whenever a multiple of 5 is crossed
            pub.publish(masters, version=n)
    assert board.keyframes("r2") == [3, 6, 10]


# -- coalescing --------------------------------------------------------------------------------


def test_coalescing_under_slow_store_never_half_publishes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = f"slow-{uuid.uuid4().hex[:12]}"
    board = Board(SlowStore(name, delay=0.01))
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            p = board.latest(RUN)
            if p is not None:
                seen.append(p.version)
                assert board.store.head(version_key(RUN, p.version)) is not None
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    masters = random_masters(2)
    expected = {}
    try:
        with (
            caplog.at_level("INFO", logger="rollpatch.publisher"),
            Publisher(board, RUN, PublisherConfig(keyframe_every=0, max_pending=1)) as pub,
        ):
            for i in range(12):
                n = pub.publish(masters)
                expected[n] = copy_masters(masters)
                nudge(masters, i)
                time.sleep(0.003)
            pub.flush()
            stats = pub.stats
    finally:
        stop.set()
        watcher.join()
    published = board.versions(RUN)
    assert published[-1] == 11 and board.latest(RUN).version == 11  # type: ignore[union-attr]
    assert stats.n_dropped > 0, "the slow store should have forced coalescing"
    assert sorted(set(stats.dropped) | set(published)) == list(range(12))
    assert not set(stats.dropped) & set(published)
    said = [
        r.getMessage() for r in caplog.records if "a newer version was waiting" in r.getMessage()
    ]
    assert len(said) == 1 and said[0].startswith(f"{RUN}@{stats.dropped[0]}: not published")
    assert [s.version for s in stats.versions] == published
    assert seen == sorted(seen)
    for prev, n in itertools.pairwise(published):
        m = board.manifest(RUN, n)
        assert m.parent == prev
        for ref in m.objects():
            assert board.fetch(ref)
    check_all(board, expected)
    MemoryStore.reset(name)


def test_flush_timeout() -> None:
    name = f"slow-{uuid.uuid4().hex[:12]}"
    with Publisher(Board(SlowStore(name, delay=0.05)), RUN) as pub:
        pub.publish(random_masters(3, n=1))
        with pytest.raises(TimeoutError):
            pub.flush(timeout=0.01)
    MemoryStore.reset(name)


# -- snapshots of torch state dicts ----------------------------------------------------------


def test_torch_state_dict_snapshot_survives_mutation() -> None:
    torch = pytest.importorskip("torch")
    name = f"slow-{uuid.uuid4().hex[:12]}"
    board = Board(SlowStore(name, delay=0.01))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16))
    model[1].to(torch.bfloat16)
    expected = {}
    with Publisher(board, RUN, PublisherConfig(max_pending=8, model_changes="allow")) as pub:
        for i in range(3):
            sd = model.state_dict()
            n = pub.publish(sd)
            expected[n] = {
                k: v.detach().float().numpy().copy() if v.dtype == torch.float32 else _bf16(v)
                for k, v in sd.items()
            }
            with torch.no_grad():  # the trainer keeps going right away
                for p in model.parameters():
                    p.add_(0.5)
        pub.publish({"w": torch.nn.Parameter(torch.ones(4, 4))}, version=10)
        pub.flush()
    for n, masters in expected.items():
        view = reconstruct(board, RUN, n)
        assert view.digest() == cast_view(masters, "bf16").digest()
    assert view["0.weight"].dtype == "BF16" and view["1.weight"].dtype == "BF16"
    assert list(reconstruct(board, RUN, 10)) == ["w"]
    with Publisher(board, "r2") as pub, pytest.raises(ConfigError, match="int64"):
        pub.publish({"steps": torch.zeros(3, dtype=torch.int64)})
    MemoryStore.reset(name)


def test_a_float32_torch_publish_does_not_import_ml_dtypes() -> None:
    """The first publish() of float32 torch tensors imported ml_dtypes (0.5-2.7 s on this
    box, in the trainer's step) though only BF16 tensors need it."""
    pytest.importorskip("torch")
    code = (
        "import sys, torch\n"
        "from rollpatch.publisher import Publisher\n"
        "with Publisher('memory://x', 'r') as pub:\n"
        "    pub.publish({'w': torch.ones(64, 64)})\n"
        "print('ml_dtypes' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def _bf16(t: Any) -> np.ndarray:
    import ml_dtypes
    import torch

    return t.detach().view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)


# -- signing ---------------------------------------------------------------------------------------


def test_signed_manifests(board: Board) -> None:
    from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root

    key, other = SigningKey.generate(), SigningKey.generate()
    signer = Signer(keys=(key,))
    masters = random_masters(10, n=1)
    with Publisher(board, RUN, PublisherConfig(signer=signer), asynchronous=False) as pub:
        pub.publish(masters)
        nudge(masters, 0)
        pub.publish(masters)
    trust = Trust(sign_root(Root.new([key.public]), [key]))
    for n in (0, 1):
        assert board.signed(RUN, n)
        Board(board.store, trust=trust).manifest(RUN, n)  # verifies
    assert reconstruct(board, RUN, trust=trust).digest() == cast_view(masters, "bf16").digest()
    wrong = Trust(sign_root(Root.new([other.public]), [other]))
    with pytest.raises(ManifestError, match="signature"):
        reconstruct(board, RUN, trust=wrong)
    with pytest.raises(ManifestError, match="signature"):  # resuming builds on its own keys only
        Publisher(board, RUN, PublisherConfig(signer=Signer(keys=(other,))))
    with Publisher(board, RUN, PublisherConfig(signer=signer), asynchronous=False) as pub:
        assert pub.publish(masters) == 2


# -- CLI ---------------------------------------------------------------------------------------------


def test_cli_publish_status_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = (tmp_path / "board").as_uri()
    ckpts = []
    masters = random_masters(11)
    for i in range(3):
        path = tmp_path / f"ckpt{i}.safetensors"
        save_view(View({k: Tensor.from_array(v) for k, v in masters.items()}), path)
        ckpts.append((path, copy_masters(masters)))
        nudge(masters, i)
    assert main(["publish", "--board", uri, "--run", RUN, str(ckpts[0][0])]) == 0
    assert "r1@0: parent none, keyframe" in capsys.readouterr().out
    assert main(["publish", "--board", uri, "--run", RUN, str(ckpts[1][0]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["version"] == 1 and out["parent"] == 0 and out["bytes"] > 0
    assert set(out["timings"]) >= {"cast_s", "encode_s", "upload_s", "total_s"}
    assert (
        main(
            [
                "publish",
                "--board",
                uri,
                "--run",
                RUN,
                str(ckpts[2][0]),
                "--version",
                "5",
                "--keyframe",
                "--step",
                "77",
            ]
        )
        == 0
    )
    assert "r1@5: parent 1, keyframe" in capsys.readouterr().out
    assert main(["publish", "--board", uri, "--run", RUN, str(ckpts[2][0]), "--version", "5"]) == 2
    assert "must increase" in capsys.readouterr().err
    assert (
        main(["publish", "--board", uri, "--run", RUN, str(ckpts[2][0]), "--format", "fp16"]) == 2
    )
    assert "another format" in capsys.readouterr().err

    assert main(["status", "--board", uri]) == 0
    text = capsys.readouterr().out
    assert "run r1: LATEST 5, 3 versions, 2 keyframes" in text and "<- LATEST" in text
    assert main(["status", "--board", uri, "--run", RUN, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["runs"][0]
    assert st["latest"] == 5 and [v["version"] for v in st["versions"]] == [0, 1, 5]
    assert [v["keyframe"] for v in st["versions"]] == [True, False, True]
    assert st["versions"][1]["patch_bytes"] > 0 and st["versions"][1]["bases"] == [0]
    board = Board(uri)
    assert st["total_bytes"] == sum(
        r.size
        for r in {r.key: r for n in (0, 1, 5) for r in board.manifest(RUN, n).objects()}.values()
    )
    assert board.manifest(RUN, 5).meta["step"] == "77"
    for n, (_, m) in zip((0, 1, 5), ckpts):
        assert reconstruct(board, RUN, n).digest() == cast_view(m, "bf16").digest()
    assert main(["status", "--board", uri, "--run", "nope"]) == 2


# -- the served snapshot ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "fp8-e4m3", "nvfp4"])
def test_served_snapshot_on_threads_is_the_cast(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Masters cast tensors at once on several threads: the same view, bit for bit and name
    for name, as one cast; nothing shares memory with the trainer's tensors; a bad entry is
    still refused by name."""
    import ml_dtypes

    from rollpatch.publisher import snapshot
    from rollpatch.publisher.snapshot import snapshot_served

    masters = random_masters(5, n=6)
    masters["emb"] = masters.pop("model.norm.weight").astype(ml_dtypes.bfloat16)  # a no-op cast
    cfg = PublisherConfig(format=fmt)
    expected = cast_view(masters, fmt)
    monkeypatch.setattr(snapshot, "_THREADED_CAST_MIN", 0)  # small masters, threaded anyway
    for threads in ("1", "3"):
        monkeypatch.setenv("ROLLPATCH_THREADS", threads)
        view = snapshot_served(masters, cfg)
        assert list(view) == list(expected) and view.metadata == expected.metadata
        for name, t in view.items():
            assert np.array_equal(t.data, expected[name].data), name
            assert not any(np.shares_memory(t.data, m) for m in masters.values())
        with pytest.raises(ConfigError, match="int64"):
            snapshot_served({**masters, "steps": np.zeros(3, np.int64)}, cfg)
