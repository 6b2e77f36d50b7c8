"""The publisher's guards (publisher/guards.py, docs/publisher.md *Guards*): names published
as engines load them (a wrapper's prefix off, tied aliases once), a diverged step's NaN or
±inf refused, a version of another model refused; each guard's ``allow`` lets it through.
A refused version writes nothing: the board's objects and LATEST are as before."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.errors import ConfigError, FormatError
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct
from rollpatch.publisher.guards import engine_names, nonfinite
from rollpatch.store import MemoryStore
from tests.pubfix import RUN, board, check_all, copy_masters, nudge, random_masters

_FIXTURES = (board,)  # used by name


def _objects(board: Board) -> list[str]:
    return sorted(board.store.list(""))


def test_wrapper_prefixes_come_off_and_tied_aliases_are_published_once(
    board: Board, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch.compile'd (or DDP-wrapped) module's state dict, with a tied head: published
    under the names the engine's checkpoint has, the alias once; said once in the log."""
    torch = pytest.importorskip("torch")
    model = torch.nn.ModuleDict(
        {"embed": torch.nn.Embedding(32, 16), "head": torch.nn.Linear(16, 32, bias=False)}
    )
    model["head"].weight = model["embed"].weight  # tied
    sd = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    assert list(sd) == ["_orig_mod.embed.weight", "_orig_mod.head.weight"]
    with (
        caplog.at_level(logging.INFO, logger="rollpatch.publisher"),
        Publisher(board, RUN, asynchronous=False) as pub,
    ):
        pub.publish(sd)
        with torch.no_grad():
            model["embed"].weight.add_(0.25)
        pub.publish({f"module.{k}": v for k, v in model.state_dict().items()})
    assert list(reconstruct(board, RUN, 0)) == list(reconstruct(board, RUN, 1)) == ["embed.weight"]
    said = [r.getMessage() for r in caplog.records]
    assert sum("wrapper prefix '_orig_mod.'" in m for m in said) == 1
    assert sum("tied alias(es)" in m and "head.weight" in m for m in said) == 1
    # as_given: every name as it came
    with Publisher(board, "r2", PublisherConfig(names="as_given"), asynchronous=False) as pub:
        pub.publish(sd)
    assert sorted(reconstruct(board, "r2", 0)) == sorted(sd)


def test_engine_names_leaves_what_is_not_a_shared_prefix_or_an_alias() -> None:
    torch = pytest.importorskip("torch")
    w = torch.zeros(8)
    a = np.zeros(4, np.float32)
    sd: dict[str, Any] = {"module.a": w[:4], "module.b": w[4:], "module.c": a, "module.d": a[:2]}
    out, taken, dropped = engine_names(sd)
    assert (list(out), taken, dropped) == (["a", "b", "c", "d"], "module.", [])  # no alias
    out, taken, dropped = engine_names({"module.a": w, "b": w})  # not every name: kept
    assert (list(out), taken, dropped) == (["b"], "", ["module.a"])  # the smallest name
    out, taken, _ = engine_names({"module._orig_mod.a": w, "module._orig_mod.b": w[:2]})
    assert (list(out), taken) == (["a", "b"], "module._orig_mod.")
    assert engine_names({"module.": w})[1] == ""  # a name that is only the prefix


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_diverged_step_is_refused_before_anything_is_written(board: Board, bad: float) -> None:
    masters = random_masters(1)
    with Publisher(board, RUN, asynchronous=False) as pub:
        pub.publish(masters)
        before = _objects(board)
        nxt = copy_masters(masters)
        nxt["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
        with pytest.raises(FormatError, match="up_proj.weight' holds NaN or infinite") as e:
            pub.publish(nxt)
        assert "nonfinite='allow'" in (e.value.hint or "")
    assert _objects(board) == before and board.versions(RUN) == [0]
    assert board.latest(RUN).version == 0  # type: ignore[union-attr]


def test_nonfinite_allow_publishes_them_and_every_path_checks(board: Board) -> None:
    """``allow``: published bit for bit (BF16 keeps NaN and ±inf). The refusal holds on the
    device path too (torch tensors on the CPU here) and for FP16/FP32 words."""
    torch = pytest.importorskip("torch")
    masters = random_masters(2)
    masters["model.norm.weight"][:3] = [np.nan, np.inf, -np.inf]
    cfg = PublisherConfig(nonfinite="allow")
    with Publisher(board, RUN, cfg, asynchronous=False) as pub:
        pub.publish(masters)
    check_all(board, {0: masters})
    dev = PublisherConfig(diff_on="device")
    with (
        Publisher(board, "dev", dev, asynchronous=False) as pub,
        pytest.raises(FormatError, match="model.norm.weight"),
    ):
        pub.publish({k: torch.from_numpy(v.copy()) for k, v in masters.items()})
    assert board.versions("dev") == []
    for kind, dt, wdt in (("f16", np.float16, np.uint16), ("f32", np.float32, np.uint32)):
        x = np.array([1.0, -65504.0, 0.0, -0.0], dt)
        assert not nonfinite(kind, x.view(wdt))
        for b in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[2] = b
            assert nonfinite(kind, y.view(wdt))

    def bf16(x: list[float]) -> np.ndarray:
        return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)

    assert not nonfinite("bf16", bf16([1.0, -3e38, 0.0, -0.0]))
    for b in (np.nan, np.inf, -np.inf):
        w = bf16([1.0, b])
        assert nonfinite("bf16", w) and nonfinite("bf16", torch.from_numpy(w.view(np.int16)))
    assert not nonfinite("e4m3", np.full(4, 0xFF, np.uint8))  # no IEEE exponent: the format's


@pytest.mark.parametrize("change", ["dropped", "added", "reshaped"])
def test_another_model_is_refused_before_anything_is_written(board: Board, change: str) -> None:
    masters = random_masters(3)
    with Publisher(board, RUN, asynchronous=False) as pub:
        pub.publish(masters)
    before = _objects(board)
    other = copy_masters(masters)
    nudge(other, 1)
    if change == "dropped":
        other.pop("model.norm.weight")
    elif change == "added":
        other["lm_head.weight"] = np.ones((8, 128), np.float32)
    else:
        other["model.norm.weight"] = np.ones(64, np.float32)
    # a resumed publisher checks against the version it resumed from
    with (
        Publisher(board, RUN, asynchronous=False) as pub,
        pytest.raises(ConfigError, match="the model changed") as e,
    ):
        pub.publish(other)
    assert "model_changes='allow'" in (e.value.hint or "")
    assert _objects(board) == before and board.latest(RUN).version == 0  # type: ignore[union-attr]
    with Publisher(board, RUN, PublisherConfig(model_changes="allow"), asynchronous=False) as pub:
        pub.publish(other)
    check_all(board, {0: masters, 1: other})


def test_cli_publish_of_another_checkpoint_fails_and_says_how_to_allow_it(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    run = [sys.executable, "-m", "rollpatch", "publish", "--board", tmp_path.as_uri()]
    run += ["--run", RUN]
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(random_masters(1), str(a))
    save_file({"w": np.ones((4, 4), np.float32)}, str(b))
    ok = subprocess.run([*run, str(a)], check=False, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([*run, str(b)], check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "the model changed" in bad.stderr, bad.stderr
    assert "--model-changes allow" in bad.stderr and "Traceback" not in bad.stderr
    assert Board(tmp_path.as_uri()).latest(RUN).version == 0  # type: ignore[union-attr]


def test_an_engine_names_the_cause_of_a_wrapped_or_tied_run() -> None:
    """Runs published before the names guard (or with names='as_given'): the engine's refusal
    says why, instead of blaming the model it was started with."""
    from rollpatch.engines.fit import FitCheck
    from rollpatch.errors import IncompatibleModelError

    check = FitCheck(
        {"embed.weight": ("BF16", (8, 4)), "norm.weight": ("BF16", (4,))},
        engine="reference",
        run=RUN,
        version=0,
    )
    with pytest.raises(IncompatibleModelError) as e:
        check.tensor("_orig_mod.norm.weight", "BF16", (4,))
    assert "wrapper's prefix '_orig_mod.'" in (e.value.hint or "")
    with pytest.raises(IncompatibleModelError) as e:
        check.names(["embed.weight", "norm.weight", "lm_head.weight"])
    assert "tie its head to the embedding" in (e.value.hint or "")
    with pytest.raises(IncompatibleModelError) as e:
        check.tensor("other.weight", "BF16", (4,))
    assert (e.value.hint or "").startswith("start the engine with the model")


def test_a_step_that_changes_most_values_is_warned_about(
    board: Board, caplog: pytest.LogCaptureFixture
) -> None:
    """Another model of the same shape published into a run (or a learning rate far above
    RL's): published (exact), with one warning naming the share; an RL-sized step: none."""
    masters = random_masters(0)
    with (
        caplog.at_level(logging.WARNING, logger="rollpatch.publisher"),
        Publisher(board, RUN, asynchronous=False) as pub,
    ):
        pub.publish(masters)
        small = copy_masters(masters)
        nudge(small, 1, lr=1e-5)
        pub.publish(small)
        assert not [r for r in caplog.records if "of the served view" in r.getMessage()]
        other = random_masters(7)  # same names and shapes, other weights
        pub.publish(other)
    said = [r.getMessage() for r in caplog.records if "of the served view" in r.getMessage()]
    assert len(said) == 1 and f"{RUN}@2: the step patch from version 1 is" in said[0]
    assert "another model of the same shape" in said[0]
    check_all(board, {0: masters, 1: small, 2: other})


def test_large_steps_are_warned_about_once_a_minute(
    board: Board, caplog: pytest.LogCaptureFixture
) -> None:
    """A run whose every step is large (an lr far too high) logged one warning per version,
    for ever (an audit, session 41): now one per LARGE_STEP_LOG_S, counting those between."""
    with (
        caplog.at_level(logging.WARNING, logger="rollpatch.publisher"),
        Publisher(board, RUN, asynchronous=False) as pub,
    ):
        for seed in range(5):
            pub.publish(random_masters(seed))
        pub._writer._large.every_s = 0.0  # the minute has passed
        pub.publish(random_masters(5))
    said = [r.getMessage() for r in caplog.records if "of the served view" in r.getMessage()]
    assert len(said) == 2, said
    assert f"{RUN}@1:" in said[0] and f"{RUN}@5:" in said[1]
    assert "(3 more such version(s) since the last line)" in said[1]


class _GatedStore(MemoryStore):
    """A memory store whose puts wait for ``gate`` (the worker busy with a version)."""

    def __init__(self, name: str, gate: threading.Event) -> None:
        super().__init__(name)
        self.gate, self.entered = gate, threading.Event()

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self.entered.set()
        assert self.gate.wait(60), "the gate was never opened"
        super()._put(key, data, if_absent=if_absent)


@pytest.mark.parametrize("snapshot", ["served", "masters"])
def test_a_diverged_step_does_not_push_the_last_good_one_out(snapshot: str) -> None:
    """The queue holds one waiting version (``max_pending=1``); a newer one used to push it
    out, even one that then failed the NaN guard: the good version never reached the board
    (an audit's LOW finding). A served snapshot is checked when it would push one out; a
    masters snapshot (cast later) is not, and the old behaviour stays there."""
    gate = threading.Event()
    store = _GatedStore(f"gated-{uuid.uuid4().hex[:12]}", gate)
    board = Board(store)
    masters = random_masters(1)
    cfg = PublisherConfig(max_pending=1, snapshot=snapshot)  # type: ignore[arg-type]
    pub = Publisher(board, RUN, cfg)
    assert pub.publish(masters) == 0
    assert store.entered.wait(60)  # the worker took it, and waits on the store
    nudge(masters, 0)
    assert pub.publish(masters) == 1  # good, waiting
    bad = copy_masters(masters)
    bad["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    assert pub.publish(bad) == 2  # diverged
    gate.set()
    with pytest.raises(FormatError, match="holds NaN or infinite"):
        pub.close()
    if snapshot == "served":
        assert board.versions(RUN) == [0, 1] and pub.stats.dropped == ()
        assert board.latest(RUN).version == 1  # type: ignore[union-attr]
    else:
        assert board.versions(RUN) == [0] and pub.stats.dropped == (1,)
