"""SGLang as a rollout engine, against a real SGLang (the extension offline:
tests/test_sglang_offline.py).

Live (the venv from ``scripts/sglang-env``; one SGLang server for the module, booted from
version 0's view): over 6 published versions of a tiny Llama, each commit is staged while
SGLang serves and scattered under its pause; after each, SGLang's weights hash to the
published digest, its greedy tokens and logprobs agree with Hugging Face transformers on that
version's weights and are bit-identical to SGLang's own full reload of that version
(``/update_weights_from_disk``), and SGLang's ``weight_version`` names it. The reverse
transition restores the outputs bit for bit; corrupted, tampered and wrong-base patches are
refused with SGLang serving its last good version. Double-buffered commits (second buffers
built while serving, storages exchanged under the pause) serve bit-identically to in-place
ones. SGLang's CPU engine runs with an
``sgl_kernel`` import shim (scripts/sglang-env): the module fails if SGLang ever called it.
Without the venv the live tests are SKIPPED, loudly, saying how to build it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.engines.fit import tensors_of_view
from rollpatch.errors import (
    BaseMismatchError,
    EngineError,
    PatchDecodeError,
    TargetMismatchError,
)
from rollpatch.patch import diff, encode
from rollpatch.view import View
from tests import live_servers, sglang_env, vllm_env
from tests.sglang_env import BUILD_HINT, sglang_python, venv_dir

# -- live: a real SGLang ----------------------------------------------------------------------

N_VERSIONS = 6  # published versions 0..5
RUN = "rl"
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 17]]
MAX_TOKENS = 8


class World:
    """The tiny model SGLang booted from (``tiny``), 6 versions published to a board (an
    RL-sized step each), their views and model dirs."""

    def __init__(self, root: Path, tiny: Path) -> None:
        from rollpatch.formats import cast_view
        from rollpatch.io.safetensors import load_view, save_view
        from rollpatch.publisher import Publisher, PublisherConfig

        masters = {
            n: t.to_array().astype(np.float32)
            for n, t in load_view(tiny / "model.safetensors").items()
        }
        rng = np.random.default_rng(16)
        self.views: list[View] = []
        self.dirs: list[Path] = []
        self.board = Board(f"file://{root / 'board'}")
        publisher = Publisher(
            self.board.store.uri,
            RUN,
            PublisherConfig(keyframe_every=0, skip_strides=()),
            asynchronous=False,
        )
        for v in range(N_VERSIONS):
            assert publisher.publish(masters) == v
            view = cast_view(masters, "bf16")
            assert self.board.manifest(RUN, v).target == view.digest()  # what was published
            self.views.append(view)
            d = root / f"v{v}"
            d.mkdir()
            for p in tiny.iterdir():
                if p.suffix != ".safetensors":
                    shutil.copy(p, d / p.name)
            save_view(view, d / "model.safetensors")
            self.dirs.append(d)
            for m in masters.values():
                m += (1e-2 * float(m.std())) * rng.standard_normal(m.shape).astype(np.float32)
        publisher.close()
        assert self.views[0].digest() == load_view(tiny / "model.safetensors").digest()

    def patch_object(self, v: int) -> bytes:
        """Version ``v``'s published patch object (from ``v - 1``), as the board holds it."""
        (po,) = self.board.manifest(RUN, v).patches_from(v - 1)
        return self.board.fetch(po.ref)


@pytest.fixture(scope="module")
def sglang_py() -> Path:
    python = sglang_python()
    if python is None:
        pytest.skip(f"SKIPPED LIVE SGLANG TESTS: no SGLang venv at {venv_dir()}: {BUILD_HINT}")
    return python


@pytest.fixture(scope="module")
def server(sglang_py: Path, live_sglang: live_servers.SharedServer) -> Iterator[vllm_env.Server]:
    """The session's SGLang server (tests.live_servers: booted from the live tiny model, i.e.
    version 0's view), holding that view; the CPU engine runs with an import shim: not one of
    its functions may have run (checked after the module, and after the server stopped)."""
    pytest.importorskip("transformers")
    srv = live_sglang.acquire()
    yield srv
    live_sglang.release()


@pytest.fixture(scope="module")
def world(
    server: vllm_env.Server,
    live_sglang: live_servers.SharedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> World:
    return World(tmp_path_factory.mktemp("sglang"), live_sglang.model)


def greedy(srv: vllm_env.Server) -> tuple[list[tuple[list[int], list[float]]], set[str]]:
    """Greedy tokens and logprobs per prompt (SGLang's native route) and the weight versions."""
    return sglang_env.greedy(srv, PROMPTS, MAX_TOKENS)


def test_versions_forward_and_back(server: vllm_env.Server, world: World) -> None:
    from rollpatch.engines.sglang import SglangEngine

    check = vllm_env.hf_checker(world.dirs[0])
    engine = SglangEngine(server.url)
    try:
        engine.adopt(0, world.views[0].digest())  # booted from version 0's view: verified
        assert engine.weight_version() == "0"
        # what a keyframe's headers are checked against (rollpatch.engines.fit)
        assert engine.model_tensors() == tensors_of_view(world.views[0])
        seen = [greedy(server)]
        assert seen[0][1] == {"0"}
        exact = check(world.views[0], PROMPTS, seen[0][0])
        for v in range(1, N_VERSIONS):
            a, b = world.views[v - 1], world.views[v]
            engine.apply_encoded([world.patch_object(v)], a.digest(), b.digest(), v)
            assert engine.version == v and engine.digest == b.digest()
            assert engine.held(fresh=True) == (b.tensor_digests(), b.digest())
            assert engine.last_timings["stage_s"] > 0 and engine.last_timings["pause_s"] > 0
            out, tags = greedy(server)
            assert tags == {str(v)}, "SGLang's weight_version must name the committed version"
            assert out != seen[-1][0], f"version {v} answers like version {v - 1}"
            exact += check(b, PROMPTS, out)  # HF transformers on this version's weights
            seen.append((out, tags))
        assert exact >= 0.9 * N_VERSIONS * len(PROMPTS) * MAX_TOKENS
        # back by decoded inverse patches (staged from the sidecar's decode path), bit-exact
        for v in range(N_VERSIONS - 2, -1, -1):
            engine.apply(diff(world.views[v + 1], world.views[v]), v)
            assert engine.held(fresh=True)[1] == world.views[v].digest()
            assert greedy(server) == (seen[v][0], {str(v)})
        # SGLang's own full reload of each version serves exactly what the patches served
        for v in (1, N_VERSIONS - 1):
            r = server.post(
                "/update_weights_from_disk",
                {"model_path": str(world.dirs[v]), "weight_version": f"disk-{v}"},
            )
            assert r["success"], r
            out, tags = greedy(server)
            assert out == seen[v][0] and tags == {f"disk-{v}"}
        engine.adopt(N_VERSIONS - 1, world.views[-1].digest())  # re-hashed after the reload
    finally:
        engine.close()


def test_bad_patches_are_refused_and_sglang_keeps_serving(
    server: vllm_env.Server, world: World
) -> None:
    from rollpatch.engines.sglang import SglangEngine

    engine = SglangEngine(server.url)
    try:
        last = N_VERSIONS - 1
        engine.load(world.views[last], last)  # a keyframe, written in place, verified
        assert engine.held(fresh=True)[1] == world.views[last].digest()
        good = greedy(server)
        a, b = world.views[last], world.views[last - 1]
        blob = bytearray(encode(diff(a, b), a))
        blob[len(blob) // 2] ^= 0x55  # corrupted in transit
        wrong_base = encode(diff(world.views[0], world.views[1]), world.views[0])
        tampered = diff(a, b)
        name = min(tampered.tensors)
        tp = tampered.tensors[name]
        tp.changes().new[0] ^= np.uint16(0x8000)  # the decoded words are not the target's
        attempts: list[tuple[Any, type[Exception]]] = [
            (
                lambda: engine.apply_encoded([bytes(blob)], a.digest(), b.digest(), 99),
                PatchDecodeError,
            ),
            (
                lambda: engine.apply_encoded(
                    [wrong_base], world.views[0].digest(), world.views[1].digest(), 99
                ),
                BaseMismatchError,
            ),
            (lambda: engine.apply(tampered, 99), TargetMismatchError),
        ]
        for attempt, err in attempts:
            with pytest.raises(err):
                attempt()
            assert engine.version == last and engine.digest == a.digest()
            assert engine.held(fresh=True)[1] == a.digest()
            assert greedy(server) == good  # still serving the last good version, tagged so
            assert engine.weight_version() == str(last)
        audit = engine.audit(1 << 30)
        assert audit is not None and audit.mismatched == () and audit.wrapped
    finally:
        engine.close()


def test_double_buffered_commits_equal_in_place_ones(server: vllm_env.Server, world: World) -> None:
    """``writes="double_buffer"``: each version's second buffers are built while SGLang
    serves and exchanged under the pause; SGLang then holds the published digest (re-hashed
    in SGLang) and serves bit-identically to in-place commits of the same versions."""
    from rollpatch.engines.sglang import SglangEngine

    served: dict[str, list[Any]] = {}
    for writes in ("in_place", "double_buffer"):
        engine = SglangEngine(server.url, writes=writes)
        try:
            engine.load(world.views[0], 0)
            outs = []
            for v in range(1, N_VERSIONS):
                a, b = world.views[v - 1], world.views[v]
                engine.apply_encoded([world.patch_object(v)], a.digest(), b.digest(), v)
                assert engine.held(fresh=True) == (b.tensor_digests(), b.digest())
                assert engine.version == v and engine.weight_version() == str(v)
                exchanged = engine.last_timings["exchanged"]
                assert (exchanged > 0) == (writes == "double_buffer"), engine.last_timings
                assert {"decode", "prove", "layout", "buffers"} <= set(engine.last_stage_ms)
                outs.append(greedy(server))
            # back by a decoded inverse patch (the sidecar's decode path), then forward again
            engine.apply(diff(world.views[-1], world.views[-2]), N_VERSIONS - 2)
            assert engine.held(fresh=True)[1] == world.views[-2].digest()
            assert greedy(server) == outs[-2]
            served[writes] = outs
        finally:
            engine.close()
    assert served["double_buffer"] == served["in_place"]
    assert len({str(o[0]) for o in served["in_place"]}) == N_VERSIONS - 1  # versions differ


def test_a_catch_up_chain_is_decoded_inside_sglang(server: vllm_env.Server, world: World) -> None:
    """``stage_encoded`` of the five published steps from version 0 (what a follower five
    behind hands over): decoded inside SGLang's process step after step against its own
    words (``stage_encoded`` answers: no fallback to the follower's decode against exported
    words), committed to version 5, which SGLang then serves
    exactly as it does after its own reload of version 5's checkpoint."""
    from rollpatch.engines.sglang import SglangEngine
    from rollpatch.engines.staged import EncodedStep

    for writes in ("in_place", "double_buffer"):
        engine = SglangEngine(server.url, writes=writes)
        try:
            engine.load(world.views[0], 0)
            steps = [
                EncodedStep((world.patch_object(v),), world.views[v - 1].digest(), d.digest())
                for v, d in enumerate(world.views[1:], start=1)
            ]
            staged = engine.stage_encoded(steps, N_VERSIONS - 1)
            assert staged is not None and staged.target == world.views[-1].digest()
            assert "decode" in engine.last_stage_ms
            engine.commit_staged(staged, N_VERSIONS - 1)
            last = world.views[-1]
            assert engine.held(fresh=True) == (last.tensor_digests(), last.digest())
            chained = greedy(server)
            assert chained[1] == {str(N_VERSIONS - 1)}
            r = server.post(
                "/update_weights_from_disk",
                {"model_path": str(world.dirs[-1]), "weight_version": "disk"},
            )
            assert r["success"], r
            assert greedy(server)[0] == chained[0]
        finally:
            engine.close()


def test_an_engine_without_the_loader_is_refused_clearly(tmp_path: Path) -> None:
    """A plain OpenAI server is not mistaken for a patched SGLang (no traceback, a hint)."""
    from rollpatch.engines.sglang import SglangEngine

    engine = SglangEngine("http://127.0.0.1:9", timeout=2)
    with pytest.raises(EngineError, match="not reachable"):
        engine.adopt(0, "0" * 64)
    engine.close()
