"""The publisher's errors surface (worker, store, sync) where the trainer sees them; bad
configuration names the field; a publisher resumes after a close, a manifest without a
pointer, or a missing keyframe marker. Helpers: tests/pubfix.py.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board, pointer_key, version_key
from rollpatch.errors import ConfigError, FormatError, StoreError
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct
from rollpatch.store import MemoryStore
from tests.pubfix import RUN, FailingStore, board, check_all, copy_masters, nudge, random_masters

_FIXTURES = (board,)  # used by name


# -- errors ------------------------------------------------------------------------------------


def test_worker_error_surfaces_on_flush_and_publish(board: Board) -> None:
    pub = Publisher(board, RUN, PublisherConfig(format="fp8-e4m3"))
    bad = random_masters(4, n=1)
    bad["model.layers.0.mlp.up_proj.weight"][0, 0] = np.nan
    pub.publish(bad)
    with pytest.raises(FormatError, match="NaN"):
        pub.flush()
    with pytest.raises(FormatError):
        pub.publish(random_masters(4, n=1))
    pub.close()  # already reported: close does not raise it again
    with pytest.raises(ConfigError, match="closed"):
        pub.publish(random_masters(4, n=1))
    assert board.latest(RUN) is None


def test_masters_no_path_can_publish_are_refused_at_once(board: Board) -> None:
    """What no snapshot path can take is a ConfigError from publish() itself, naming the
    tensor, before anything is queued: not a torch error from inside a copy."""
    torch = pytest.importorskip("torch")
    pub = Publisher(board, RUN, PublisherConfig(), asynchronous=False)
    bad = {
        "meta device": {"w": torch.empty(4, 4, device="meta")},
        "sparse_coo, not dense": {"w": torch.ones(4, 4).to_sparse()},
        "float8_e4m3fn": {"w": torch.ones(4, 4).to(torch.float8_e4m3fn)},
        "int64": {"w": torch.ones(3, dtype=torch.int64)},
        "float64": {"w": np.ones(4)},
        "state dict is empty": {},
    }
    for said, sd in bad.items():
        with pytest.raises(ConfigError, match=said):
            pub.publish(sd)
    with pytest.raises(ConfigError, match="step must be a non-negative int"):
        pub.publish({"w": torch.ones(4, 4)}, step="abc")  # type: ignore[arg-type]
    assert board.latest(RUN) is None
    assert pub.publish({"w": torch.ones(4, 4)}) == 0  # the publisher is still usable
    pub.close()


def test_store_error_surfaces_on_close() -> None:
    name = f"fail-{uuid.uuid4().hex[:12]}"
    gate = threading.Event()  # no put fails before every publish() returned
    board = Board(FailingStore(name, ok=4, gate=gate))
    pub = Publisher(board, RUN, PublisherConfig(max_pending=10))
    masters = random_masters(5, n=1)
    for i in range(4):
        pub.publish(masters)
        nudge(masters, i)
    gate.set()
    with pytest.raises(StoreError, match="injected"):
        pub.close()
    pub.close()
    latest = board.latest(RUN)
    assert latest is not None and latest.version == board.versions(RUN)[-1]
    MemoryStore.reset(name)


def test_sync_error_raises_from_publish(board: Board) -> None:
    cfg = PublisherConfig(format="fp8-e4m3", nonfinite="allow")  # the format's own refusal
    pub = Publisher(board, RUN, cfg, asynchronous=False)
    bad = random_masters(6, n=1)
    bad["model.norm.weight"][:] = np.inf  # norm stays BF16: inf is allowed there
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
    masters = random_masters(7)
    expected = {}
    cfg = PublisherConfig(keyframe_every=3, skip_strides=(2,), max_pending=10)
    for session in range(3):
        with Publisher(board, RUN, cfg, asynchronous=session != 1) as pub:
            assert pub.last_durable == (None if session == 0 else 3 * session - 1)
            for _ in range(3):
                n = pub.publish(masters)
                expected[n] = copy_masters(masters)
                nudge(masters, n)
            pub.flush()
            assert pub.stats.versions[0].resume_s > 0 or session == 0
    assert board.versions(RUN) == list(range(9))
    assert board.keyframes(RUN) == [0, 3, 6]
    assert [board.manifest(RUN, n).parent for n in (3, 6)] == [2, 5]
    assert {p.base for p in board.manifest(RUN, 4).patches} == {2, 3}  # skip right after resume
    check_all(board, expected)
    stray = Publisher(board, RUN, cfg, asynchronous=False)
    with pytest.raises(ConfigError, match="increase"):
        stray.publish(masters, version=8)
    stray.close()  # one publisher per run: the next one starts only once it let go
    with pytest.raises(ConfigError, match="another format"):
        Publisher(board, RUN, PublisherConfig(format="fp16"))


def test_versions_pending_at_interpreter_exit_are_published(tmp_path: Path) -> None:
    """A trainer that ends without close(): the exit hook publishes what is pending. As a
    plain atexit hook it ran after Python's thread pools had stopped taking work, and every
    pending version was lost ("cannot schedule new futures after interpreter shutdown")."""
    import subprocess
    import sys

    board = tmp_path / "board"
    script = (
        "import numpy as np\n"
        "from rollpatch.publisher import Publisher, PublisherConfig\n"
        "w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)\n"
        f"pub = Publisher({board.as_uri()!r}, 'x', PublisherConfig(max_pending=8))\n"
        "pub.publish({'w': w}); pub.flush()\n"
        "for i in range(1, 4):\n"
        "    pub.publish({'w': w + i * 1e-2})\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "failed" not in r.stderr, r.stderr
    b = Board(board.as_uri())
    assert b.versions("x") == [0, 1, 2, 3] and b.latest("x").version == 3
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    check_all_run(b, "x", {3: {"w": w + 3 * 1e-2}})


def check_all_run(board: Board, run: str, expected: dict[int, dict[str, np.ndarray]]) -> None:
    for n, masters in expected.items():
        view = reconstruct(board, run, n)
        assert view.digest() == cast_view(masters, "bf16").digest() == board.manifest(run, n).target


def test_a_resumed_publisher_drops_and_renames_tensors_soundly(
    board: Board, caplog: pytest.LogCaptureFixture
) -> None:
    """After a restart the trainer's state dict may lack a tensor, or name every tensor
    otherwise (a DDP ``module.`` prefix). The resumed publisher's base is the whole previous
    view, so the step drops what is gone and ships the new names whole: versions every
    follower rebuilds. (It used to leave the missing names out of its base: the patch bound
    other digests than its manifest, LATEST named it anyway, and every pull and publish on
    the run failed after it.)"""
    masters = random_masters(3, n=1)
    expected = {}
    cfg = PublisherConfig(model_changes="allow", names="as_given")  # what the guards refuse
    with Publisher(board, RUN, cfg, asynchronous=False) as pub:
        expected[pub.publish(masters)] = copy_masters(masters)
    gone = min(masters)
    fewer = {k: v for k, v in copy_masters(masters).items() if k != gone}
    renamed = {f"module.{k}": v for k, v in copy_masters(masters).items()}
    for sd in (fewer, renamed):
        caplog.clear()
        with (
            caplog.at_level("WARNING", logger="rollpatch.publisher"),
            Publisher(board, RUN, cfg, asynchronous=False) as pub,
        ):
            n = pub.publish(sd)
            expected[n] = copy_masters(sd)
            stats = pub.stats.versions[-1]
        assert stats.tensors_dropped == (1 if sd is fewer else len(fewer))
        assert stats.tensors_whole == (0 if sd is fewer else len(renamed))
        # engines started with the previous model cannot load it: said as a warning
        said = [r.getMessage() for r in caplog.records if "cannot load it" in r.getMessage()]
        assert len(said) == 1 and f"{RUN}@{n}: {stats.tensors_whole} tensor(s)" in said[0]
    assert board.versions(RUN) == [0, 1, 2]
    check_all(board, expected)
    with Publisher(board, RUN, cfg, asynchronous=False) as pub:
        expected[pub.publish(renamed)] = copy_masters(renamed)  # and the run goes on
    check_all(board, expected)


def _assembly() -> dict[str, Any]:
    """assemble_manifest's arguments for version 1 on top of version 0, but the messages."""
    return {
        "run": RUN,
        "version": 1,
        "parent": 0,
        "keyframe": False,
        "root_digests": {0: "b" * 64},
        "config": PublisherConfig(),
        "meta": {},
    }


def test_a_patch_that_binds_other_roots_is_never_published() -> None:
    """Rank 0 checks that an unsharded version's patch objects bind the manifest's roots
    (what followers require) before the manifest is written: a publisher bug that wrote
    another is refused, and LATEST stays on the last good version."""
    from rollpatch.errors import BoardError
    from rollpatch.publisher.assemble import assemble_manifest

    good = {"key": "runs/r/objects/x.rpatch", "size": 1, "b3": "0" * 64, "base": 0}
    msg = {"ok": True, "nbytes": 8, "digests": {"a": "1" * 64}, "keyframe": None}
    kw = _assembly()
    m = assemble_manifest(messages=[{**msg, "patches": [good]}], **kw)
    right = {**good, "binds": ["b" * 64, m.target]}
    assert assemble_manifest(messages=[{**msg, "patches": [right]}], **kw).target == m.target
    for binds in (["c" * 64, m.target], ["b" * 64, "d" * 64]):
        with pytest.raises(BoardError, match="does not bind"):
            assemble_manifest(messages=[{**msg, "patches": [{**good, "binds": binds}]}], **kw)


def test_a_sharded_resume_that_loses_a_tensor_is_refused() -> None:
    """Sharded ranks resumed on the whole view cut it to their new names, so a tensor no rank
    publishes any more would vanish with no drop in any patch; rank 0 refuses that version
    (each such rank reports the names it resumed on) instead of writing it."""
    from rollpatch.errors import BoardError
    from rollpatch.publisher.assemble import assemble_manifest

    def msg(name: str, resumed: list[str] | None) -> dict[str, Any]:
        ref = {"key": f"runs/r/objects/{name}.rpatch", "size": 1, "b3": "0" * 64, "base": 0}
        out = {"ok": True, "nbytes": 8, "digests": {name: "1" * 64}, "keyframe": None}
        return {**out, "patches": [ref], **({"resumed": resumed} if resumed else {})}

    kw = _assembly()
    assert assemble_manifest(messages=[msg("a", ["a", "b"]), msg("b", None)], **kw).shards == 2
    with pytest.raises(BoardError, match="in no rank's shard") as err:
        assemble_manifest(messages=[msg("a", None), msg("b", ["a", "b", "c"])], **kw)
    assert err.value.context["tensor"] == "c"


def test_resume_rolls_forward_a_manifest_without_pointer(board: Board) -> None:
    masters = random_masters(8)
    with Publisher(board, RUN, asynchronous=False) as pub:
        for i in range(3):
            pub.publish(masters)
            nudge(masters, i)
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
    masters = random_masters(9, n=1)
    with Publisher(board, RUN, asynchronous=False) as pub:
        pub.publish(masters)
    # died between the manifest and its keyframe marker: no marker, no LATEST
    board.store.delete(f"runs/{RUN}/keyframes/{0:012d}")
    board.store.delete(pointer_key(RUN))
    with Publisher(board, RUN, asynchronous=False) as pub:
        assert pub.publish(masters) == 1
    assert board.keyframes(RUN) == [0]
    assert reconstruct(board, RUN).digest() == cast_view(masters, "bf16").digest()


def test_a_second_publisher_on_the_run_is_refused_at_its_start(board: Board) -> None:
    """Two trainers publishing one run by mistake (an audit, session 40): the second resumed
    and raced the first for each version, and the loser found out only at a manifest. Now the
    run's lease (publisher/lease.py) refuses the second at its start, naming the first; a
    takeover stops the first before its next manifest, naming the second."""
    from rollpatch.errors import ConflictError

    masters = random_masters(seed=1)
    first = Publisher(board, RUN, PublisherConfig(publisher_id="trainer-a"), asynchronous=False)
    first.publish(copy_masters(masters))
    with pytest.raises(ConfigError, match="being published by 'trainer-a'") as refused:
        Publisher(board, RUN, PublisherConfig(publisher_id="trainer-b"), asynchronous=False)
    assert "takeover=True" in str(refused.value)
    cfg = PublisherConfig(publisher_id="trainer-b", takeover=True)
    second = Publisher(board, RUN, cfg, asynchronous=False)
    nudge(masters, seed=2)
    assert second.publish(copy_masters(masters)) == 1
    nudge(masters, seed=3)
    with pytest.raises(ConflictError, match="taken over by publisher 'trainer-b'") as lost:
        first.publish(masters)  # its own version 1: stopped before the manifest
    assert "this publisher is trainer-a" in str(lost.value)
    assert board.versions(RUN) == [0, 1]
    assert board.manifest(RUN, 1).publisher == "trainer-b"
    first.close()  # synchronous: the error was raised by publish() itself
    second.close()
    third = Publisher(board, RUN, PublisherConfig(publisher_id="trainer-c"), asynchronous=False)
    assert third.last_durable == 1  # a closed publisher lets go at once
    third.close()


def test_a_version_that_does_not_become_durable_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A frozen store: the async publisher accepted (and coalesced) versions for minutes with
    no line at WARNING (an audit, session 40). Now a version in progress longer than STALL_S
    is said, once per STALL_S, while publish() goes on accepting."""
    import logging
    import time

    from rollpatch.publisher import rounds
    from tests.pubfix import SlowStore

    monkeypatch.setattr(rounds, "STALL_S", 0.2)
    slow = Board(SlowStore(f"stall-{uuid.uuid4().hex}", delay=0.5))  # each put: 0.5 s
    masters = random_masters(seed=4)
    said: list[str] = []
    with (
        caplog.at_level(logging.WARNING, logger="rollpatch.publisher"),
        Publisher(slow, RUN) as pub,
    ):
        t0 = time.monotonic()
        while not said and time.monotonic() - t0 < 20:  # publish() is where it is said
            nudge(masters, seed=len(said) + 5)
            pub.publish(copy_masters(masters))
            time.sleep(0.1)
            said = [r.getMessage() for r in caplog.records if "not durable after" in r.getMessage()]
        elapsed = time.monotonic() - t0
    assert said and "version(s) wait" in said[0], said
    assert len(said) <= elapsed / 0.2 + 1  # at most one line per STALL_S
