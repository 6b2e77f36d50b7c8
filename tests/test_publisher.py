"""The publisher: versions reconstruct bit-exactly, cadence, skips, coalescing, errors, resume."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board, pointer_key, version_key
from rollpatch.cli import main
from rollpatch.errors import (
    ConfigError,
    FormatError,
    ManifestError,
    StoreError,
    TransientStoreError,
)
from rollpatch.formats import cast_view
from rollpatch.io import save_view
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct
from rollpatch.sim import AdamSim, SimConfig
from rollpatch.store import MemoryStore
from rollpatch.view import Tensor, View

RUN = "r1"


def _copy(masters: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in masters.items()}


def _random_masters(seed: int, n: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {
        f"model.layers.{i}.mlp.up_proj.weight": (rng.standard_normal((64, 128)) * 0.02).astype(
            np.float32
        )
        for i in range(n)
    }
    out["model.norm.weight"] = np.ones(128, np.float32)
    return out


def _nudge(masters: dict[str, np.ndarray], seed: int, lr: float = 3e-4) -> None:
    rng = np.random.default_rng(seed)
    for v in masters.values():
        v += (lr * rng.standard_normal(v.shape)).astype(v.dtype)


class SlowStore(MemoryStore):
    """A memory store whose puts take ``delay`` seconds (an uplink slower than training)."""

    def __init__(self, name: str, delay: float) -> None:
        super().__init__(name)
        self.delay = delay

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        time.sleep(self.delay)
        super()._put(key, data, if_absent=if_absent)


class FailingStore(MemoryStore):
    """Fails every put after the first ``ok`` puts."""

    def __init__(self, name: str, ok: int) -> None:
        super().__init__(name)
        self.ok = ok

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        if self.ok <= 0:
            raise TransientStoreError("injected upload failure", key=key)
        self.ok -= 1
        super()._put(key, data, if_absent=if_absent)


@pytest.fixture
def board(memory_board: Board) -> Board:
    return memory_board


def _check_all(board: Board, expected: dict[int, dict[str, np.ndarray]], fmt: str = "bf16") -> None:
    """Every published version reconstructs to the cast of its masters, bit for bit."""
    for n in board.versions(RUN):
        view = reconstruct(board, RUN, n)
        want = cast_view(expected[n], fmt)
        assert view.digest() == want.digest() == board.manifest(RUN, n).target, n
        for name, t in want.items():
            assert np.array_equal(view[name].data, t.data), (n, name)


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
            expected[n] = _copy(sim.masters())
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
    _check_all(board, expected)
    m4, m8 = board.manifest(RUN, 4), board.manifest(RUN, 8)
    assert {p.base for p in m4.patches} == {0, 2, 3}
    assert {p.base for p in m8.patches} == {4, 6, 7}
    assert m8.meta == {"step": "8", "scales": "bf16"}
    plan = board.plan(RUN, 0, 8)
    assert [(s.base, s.to) for s in plan.steps] == [(0, 4), (4, 8)]
    assert [(s.base, s.to) for s in board.plan(RUN, 1, 6).steps] == [(1, 2), (2, 4), (4, 6)]
    assert [(s.base, s.to) for s in board.plan(RUN, None, 6).steps] == [(None, 4), (4, 6)]


def test_quantised_format_and_meta(board: Board) -> None:
    masters = _random_masters(0)
    cfg = PublisherConfig(format="fp8-e4m3", scales="bf16", keyframe_every=0)
    expected = {}
    with Publisher(board, RUN, cfg, asynchronous=False) as pub:
        for i in range(4):
            expected[pub.publish(masters, step=100 + i)] = _copy(masters)
            _nudge(masters, i, lr=3e-3)
    assert board.keyframes(RUN) == [0]
    assert board.manifest(RUN, 2).meta["step"] == "102"
    assert board.manifest(RUN, 2).format == "fp8-e4m3"
    _check_all(board, expected, "fp8-e4m3")


def test_keyframe_cadence_and_publish_keyframe(board: Board) -> None:
    masters = _random_masters(1, n=1)
    with Publisher(
        board, RUN, PublisherConfig(keyframe_every=0, skip_strides=()), asynchronous=False
    ) as pub:
        for i in range(3):
            if i == 2:
                pub.publish_keyframe()
            pub.publish(masters)
            _nudge(masters, i)
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


def test_coalescing_under_slow_store_never_half_publishes() -> None:
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
    masters = _random_masters(2)
    expected = {}
    try:
        with Publisher(board, RUN, PublisherConfig(keyframe_every=0, max_pending=1)) as pub:
            for i in range(12):
                n = pub.publish(masters)
                expected[n] = _copy(masters)
                _nudge(masters, i)
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
    assert [s.version for s in stats.versions] == published
    assert seen == sorted(seen)
    for prev, n in itertools.pairwise(published):
        m = board.manifest(RUN, n)
        assert m.parent == prev
        for ref in m.objects():
            assert board.fetch(ref)
    _check_all(board, expected)
    MemoryStore.reset(name)


def test_flush_timeout() -> None:
    name = f"slow-{uuid.uuid4().hex[:12]}"
    with Publisher(Board(SlowStore(name, delay=0.05)), RUN) as pub:
        pub.publish(_random_masters(3, n=1))
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
    with Publisher(board, RUN, PublisherConfig(max_pending=8)) as pub:
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


def _bf16(t: Any) -> np.ndarray:
    import ml_dtypes
    import torch

    return t.detach().view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)


# -- errors ------------------------------------------------------------------------------------


def test_worker_error_surfaces_on_flush_and_publish(board: Board) -> None:
    pub = Publisher(board, RUN, PublisherConfig(format="fp8-e4m3"))
    bad = _random_masters(4, n=1)
    bad["model.layers.0.mlp.up_proj.weight"][0, 0] = np.nan
    pub.publish(bad)
    with pytest.raises(FormatError, match="NaN"):
        pub.flush()
    with pytest.raises(FormatError):
        pub.publish(_random_masters(4, n=1))
    pub.close()  # already reported: close does not raise it again
    with pytest.raises(ConfigError, match="closed"):
        pub.publish(_random_masters(4, n=1))
    assert board.latest(RUN) is None


def test_store_error_surfaces_on_close() -> None:
    name = f"fail-{uuid.uuid4().hex[:12]}"
    board = Board(FailingStore(name, ok=4))
    pub = Publisher(board, RUN, PublisherConfig(max_pending=10))
    masters = _random_masters(5, n=1)
    for i in range(4):
        pub.publish(masters)
        _nudge(masters, i)
    with pytest.raises(StoreError, match="injected"):
        pub.close()
    pub.close()
    latest = board.latest(RUN)
    assert latest is not None and latest.version == board.versions(RUN)[-1]
    MemoryStore.reset(name)


def test_sync_error_raises_from_publish(board: Board) -> None:
    pub = Publisher(board, RUN, PublisherConfig(format="fp8-e4m3"), asynchronous=False)
    bad = _random_masters(6, n=1)
    bad["model.norm.weight"][:] = np.inf  # norm stays BF16: inf is fine there
    pub.publish(bad)
    bad["model.layers.0.mlp.up_proj.weight"][:] = np.inf
    with pytest.raises(FormatError):
        pub.publish(bad)
    with pytest.raises(FormatError):
        pub.flush()
    pub.close()


@pytest.mark.parametrize(
    "field,value",
    [
        ("format", "fp7"),
        ("scales", "fp64"),
        ("keyframe_every", -1),
        ("skip_strides", (1,)),
        ("skip_strides", "8"),
        ("max_pending", 0),
        ("publisher_id", ""),
        ("signer", b"k" * 32),
        ("policy", "attn"),
    ],
)
def test_config_validation_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"PublisherConfig.{field}"):
        PublisherConfig(**{field: value})


def test_config_repr_hides_the_key() -> None:
    from rollpatch.trust import Signer, SigningKey

    key = SigningKey.generate()
    text = repr(PublisherConfig(signer=Signer(keys=(key,))))
    assert "PRIVATE" not in text and key.to_pem().decode().splitlines()[1] not in text
    assert PublisherConfig(skip_strides=(8, 4, 8)).skip_strides == (4, 8)


# -- resume --------------------------------------------------------------------------------------


def test_resume_after_close(board: Board) -> None:
    masters = _random_masters(7)
    expected = {}
    cfg = PublisherConfig(keyframe_every=3, skip_strides=(2,), max_pending=10)
    for session in range(3):
        with Publisher(board, RUN, cfg, asynchronous=session != 1) as pub:
            assert pub.last_durable == (None if session == 0 else 3 * session - 1)
            for _ in range(3):
                n = pub.publish(masters)
                expected[n] = _copy(masters)
                _nudge(masters, n)
            pub.flush()
            assert pub.stats.versions[0].resume_s > 0 or session == 0
    assert board.versions(RUN) == list(range(9))
    assert board.keyframes(RUN) == [0, 3, 6]
    assert [board.manifest(RUN, n).parent for n in (3, 6)] == [2, 5]
    assert {p.base for p in board.manifest(RUN, 4).patches} == {2, 3}  # skip right after resume
    _check_all(board, expected)
    with pytest.raises(ConfigError, match="increase"):
        Publisher(board, RUN, cfg, asynchronous=False).publish(masters, version=8)
    with pytest.raises(ConfigError, match="another format"):
        Publisher(board, RUN, PublisherConfig(format="fp16"))


def test_resume_rolls_forward_a_manifest_without_pointer(board: Board) -> None:
    masters = _random_masters(8)
    with Publisher(board, RUN, asynchronous=False) as pub:
        for i in range(3):
            pub.publish(masters)
            _nudge(masters, i)
    # a publisher died after writing manifest 2 but before advancing LATEST
    raw = json.dumps(
        {
            "run": RUN,
            "version": 1,
            "manifest": version_key(RUN, 1),
            "target": board.manifest(RUN, 1).target,
        },
        sort_keys=True,
    ).encode()
    board.store.put(pointer_key(RUN), raw, if_absent=False)
    assert board.latest(RUN).version == 1  # type: ignore[union-attr]
    with Publisher(board, RUN, asynchronous=False) as pub:
        assert board.latest(RUN).version == 2  # type: ignore[union-attr]
        assert pub.publish(masters) == 3
    assert board.manifest(RUN, 3).parent == 2
    assert reconstruct(board, RUN).digest() == cast_view(masters, "bf16").digest()


def test_resume_restores_a_missing_keyframe_marker(board: Board) -> None:
    masters = _random_masters(9, n=1)
    with Publisher(board, RUN, asynchronous=False) as pub:
        pub.publish(masters)
    # died between the manifest and its keyframe marker: no marker, no LATEST
    board.store.delete(f"runs/{RUN}/keyframes/{0:012d}")
    board.store.delete(pointer_key(RUN))
    with Publisher(board, RUN, asynchronous=False) as pub:
        assert pub.publish(masters) == 1
    assert board.keyframes(RUN) == [0]
    assert reconstruct(board, RUN).digest() == cast_view(masters, "bf16").digest()


# -- signing ---------------------------------------------------------------------------------------


def test_signed_manifests(board: Board) -> None:
    from rollpatch.trust import Root, Signer, SigningKey, Trust, sign_root

    key, other = SigningKey.generate(), SigningKey.generate()
    signer = Signer(keys=(key,))
    masters = _random_masters(10, n=1)
    with Publisher(board, RUN, PublisherConfig(signer=signer), asynchronous=False) as pub:
        pub.publish(masters)
        _nudge(masters, 0)
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
    masters = _random_masters(11)
    for i in range(3):
        path = tmp_path / f"ckpt{i}.safetensors"
        save_view(View({k: Tensor.from_array(v) for k, v in masters.items()}), path)
        ckpts.append((path, _copy(masters)))
        _nudge(masters, i)
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
