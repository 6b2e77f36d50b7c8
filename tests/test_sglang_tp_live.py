"""SGLang at ``--tp-size 2``, live (the rank logic offline: tests/test_sglang_tp.py).

One SGLang server for the module (the venv from ``scripts/sglang-env``; two ranks, one core
each; started with ``ROLLPATCH_FAULT_INJECTION=1`` for the partial-rank failure), booted from
version 0 of the tiny Llama of tests/test_sglang.py:

- **versions**: the adapter verifies the booted weights from the ranks' sums; version 1's
  published patch object is decoded against the words gathered from both ranks, versions 2
  and 3's inside SGLang (each touched tensor by the rank that owns it, ``stage_encoded``), each
  staged on both ranks and committed under SGLang's pause; after each commit the re-hashed weights give the
  published digest and ``weight_version`` names the version; SGLang's own full reload of a
  version at TP 2 serves bit-identically; a reverse transition restores the outputs; a
  tampered patch is refused with SGLang serving its last good version; a chain of two reverse
  steps, staged by the owner ranks at once, brings it back to version 1;
- **a partial-rank failure**: a word the staged update overwrites is changed behind the
  digests on rank 1 only; the commit is refused (rank 1's check fails while rank 0 has
  written), rank 0's writes are undone, both ranks re-hash to the held version, SGLang serves
  it and ``weight_version`` names it; the same update then commits. Double-buffered, rank 1's
  staged update is dropped before the commit: rank 0 exchanges its old storage back;
- **the sidecar** (``rollpatch sidecar --engine sglang --writes double_buffer``, its own
  process: second buffers on both ranks, storages exchanged under the pause) joins the run from
  its keyframe and follows three more versions; every response is labelled, SGLang's own
  ``weight_version`` says the same, and its greedy tokens and logprobs agree with Hugging Face
  transformers on the labelled version's weights.

Without the venv the module is SKIPPED, loudly.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.patch import diff
from tests import vllm_env
from tests.test_sglang import PROMPTS, World, greedy

Served = tuple[vllm_env.Server, Path]


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from tests import live_servers
    from tests.sglang_env import BUILD_HINT, sglang_python, start_server, venv_dir

    python = sglang_python()
    if python is None:
        pytest.skip(f"SKIPPED LIVE SGLANG TP TEST: no SGLang venv at {venv_dir()}: {BUILD_HINT}")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED LIVE SGLANG TP TEST: --tp-size 2 needs 2 cores here")
    pytest.importorskip("transformers")
    pytest.importorskip("openai")
    from rollpatch.engines.reference import make_tiny_model

    root = tmp_path_factory.mktemp("sglang-tp")
    with contextlib.redirect_stderr(io.StringIO()):
        make_tiny_model(root / "model", **live_servers.LIVE_MODEL)
    shim = root / "sgl-kernel-shim.log"
    srv = start_server(
        python,
        root / "model",
        root / "sglang.log",
        shim,
        tp=2,
        extra_env={"ROLLPATCH_FAULT_INJECTION": "1"},
    )
    try:
        srv.wait_ready(600)
        yield srv, root
    finally:
        srv.stop()
    calls = shim.read_text() if shim.exists() else ""
    assert not calls, f"SGLang called the sgl_kernel import shim:\n{calls}"


@pytest.fixture(scope="module")
def world(tp_server: Served) -> World:
    _, root = tp_server
    return World(root / "world", root / "model")


def test_live_tp2_versions_forward_back_and_refusals(tp_server: Served, world: World) -> None:
    from rollpatch.engines.sglang import SglangEngine
    from rollpatch.engines.staged import EncodedStep
    from rollpatch.errors import TargetMismatchError
    from rollpatch.patch import decode
    from rollpatch.patch.wire import encode_views

    server, _ = tp_server
    engine = SglangEngine(server.url)
    try:
        assert engine.tp == 2 and engine.info()["tp"] == 2
        engine.adopt(0, world.views[0].digest())  # the ranks' sums add up to version 0
        seen = [greedy(server)[0]]
        last = 3
        for v in range(1, last + 1):
            b = world.views[v]
            assert engine.stage_encoded([], v) is None
            if v == 1:  # decoded here, against the words gathered from both ranks
                engine.apply(decode(world.patch_object(v), engine.words()), v)
            else:  # decoded inside SGLang, each touched tensor by the rank that owns it
                step = EncodedStep(
                    (world.patch_object(v),), world.views[v - 1].digest(), b.digest()
                )
                staged = engine.stage_encoded([step], v)
                assert staged is not None and {"gather", "decode"} <= set(engine.last_stage_ms)
                engine.commit_staged(staged, v)
            assert engine.version == v and engine.digest == b.digest()
            assert engine.held(fresh=True) == (b.tensor_digests(), b.digest())
            out, tags = greedy(server)
            assert tags == {str(v)} and out != seen[-1]
            seen.append(out)
        assert engine.words()["model.layers.0.mlp.down_proj.weight"].data.tobytes() == (
            world.views[last]["model.layers.0.mlp.down_proj.weight"].data.tobytes()
        )  # a row-split tensor, gathered from both ranks
        engine.apply(diff(world.views[last], world.views[last - 1]), last - 1)  # back
        assert engine.held(fresh=True)[1] == world.views[last - 1].digest()
        assert greedy(server) == (seen[last - 1], {str(last - 1)})
        a, b = world.views[last - 1], world.views[last]
        tampered = diff(a, b)
        name = "model.layers.1.self_attn.o_proj.weight"
        tampered.tensors[name].changes().new[0] ^= np.uint16(0x8000)
        with pytest.raises(TargetMismatchError):
            engine.apply(tampered, last)
        assert engine.version == last - 1 and engine.held(fresh=True)[1] == a.digest()
        assert greedy(server) == (seen[last - 1], {str(last - 1)})
        r = server.post(  # SGLang's own full reload of the last version, at TP 2
            "/update_weights_from_disk",
            {"model_path": str(world.dirs[last]), "weight_version": f"disk-{last}"},
        )
        assert r["success"], r
        assert greedy(server) == (seen[last], {f"disk-{last}"})
        engine.adopt(last, world.views[last].digest())
        back = [  # a chain of two reverse steps, v3 -> v1, staged by the owner ranks at once
            EncodedStep(
                (encode_views(world.views[v], world.views[v - 1]),),
                world.views[v].digest(),
                world.views[v - 1].digest(),
            )
            for v in (last, last - 1)
        ]
        staged = engine.stage_encoded(back, last - 2)
        assert staged is not None
        engine.commit_staged(staged, last - 2)
        assert engine.held(fresh=True) == (world.views[1].tensor_digests(), world.views[1].digest())
        assert greedy(server) == (seen[last - 2], {str(last - 2)})
        audit = engine.audit(1 << 30)
        assert audit is not None and audit.mismatched == () and audit.wrapped
    finally:
        engine.close()


def _rank_sums(engine: Any) -> list[dict[str, Any]]:
    """Every rank's blocks, re-hashed there (``[dim, start, length, s0, s1]`` per tensor)."""
    return [engine.channel.control("digest", rank=r, fresh=True)["blocks"] for r in range(2)]


def test_live_tp2_partial_rank_failure_is_undone_on_every_rank(
    tp_server: Served, world: World
) -> None:
    """Rank 1's check fails mid-commit (a word changed behind the digests, where the staged
    update writes); rank 0 has written; the commit is refused and undone everywhere."""
    from rollpatch.engines.sglang import SglangEngine
    from rollpatch.engines.sglang.wire import result
    from rollpatch.errors import BaseMismatchError

    server, _ = tp_server
    engine = SglangEngine(server.url)
    try:
        have, want = 1, 2
        a, b = world.views[have], world.views[want]
        engine.load(a, have)  # a keyframe, written in place on both ranks, verified
        before, served = _rank_sums(engine), greedy(server)
        assert served[1] == {str(have)}
        patch = diff(a, b)
        name = "model.layers.0.mlp.down_proj.weight"  # row-split: rank 1 holds the right half
        cols = a[name].shape[1]
        pos = patch.tensors[name].changes().positions
        mine = pos[pos % cols >= cols // 2]
        assert mine.size > 2
        staged = engine.stage(patch, want)  # proven on both ranks, nothing written
        assert staged is not None
        flip = {"op": "flip", "name": name, "position": int(mine[mine.size // 2])}
        answers = engine.channel.commands([{"op": "noop"}, flip], flush=False)
        assert result(answers[1])["flipped"] == 1  # behind rank 1's sums only
        with pytest.raises(BaseMismatchError) as err:
            engine.commit_staged(staged, want)
        assert err.value.context["rank"] == 1 and err.value.context["undone_ranks"] == "[0]"
        assert engine.version == have and engine.digest == a.digest()
        assert _rank_sums(engine) == before  # each rank re-hashed: the held version's words
        assert engine.held(fresh=True) == (a.tensor_digests(), a.digest())
        assert engine.weight_version() == str(have)
        assert greedy(server) == served  # still serving it, tagged so
        engine.apply(patch, want)  # the same update, staged again: it commits
        assert engine.held(fresh=True) == (b.tensor_digests(), b.digest())
        out, tags = greedy(server)
        assert tags == {str(want)} and out != served[0]
    finally:
        engine.close()
    _double_buffered_partial_failure(server, world, want)


def _double_buffered_partial_failure(server: vllm_env.Server, world: World, have: int) -> None:
    """Double-buffered: rank 1's staged update is gone when the commit comes (its commit
    fails, rank 0 has exchanged its storage): rank 0 exchanges the old storage back."""
    from rollpatch.engines.sglang import SglangEngine
    from rollpatch.errors import EngineError

    engine = SglangEngine(server.url, writes="double_buffer")
    try:
        a, b = world.views[have], world.views[have + 1]
        engine.adopt(have, a.digest())  # re-hashed on both ranks
        before, served = _rank_sums(engine), greedy(server)
        patch = diff(a, b)
        staged = engine.stage(patch, have + 1)  # both ranks' second buffers built
        assert staged is not None
        engine.channel.control("drop", rank=1)
        with pytest.raises(EngineError, match="no staged update") as err:
            engine.commit_staged(staged, have + 1)
        assert err.value.context["rank"] == 1 and err.value.context["undone_ranks"] == "[0]"
        assert engine.version == have and engine.weight_version() == str(have)
        assert _rank_sums(engine) == before
        assert greedy(server) == served
        engine.apply(patch, have + 1)  # staged again, exchanged on both ranks
        assert engine.last_timings["exchanged"] > 0
        assert engine.held(fresh=True) == (b.tensor_digests(), b.digest())
        out, tags = greedy(server)
        assert tags == {str(have + 1)} and out != served[0]
    finally:
        engine.close()


def _complete(
    client: Any, model: Path, prompt: int, **rollpatch: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    raw = client.completions.with_raw_response.create(
        model=str(model),
        prompt=PROMPTS[prompt],
        max_tokens=8,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_token_ids": True, "rollpatch": rollpatch},
    )
    return raw.http_response.json(), {k.lower(): v for k, v in raw.headers.items()}


def test_live_tp2_sidecar_labels_every_response(tp_server: Served, tmp_path: Path) -> None:
    """``rollpatch sidecar --engine sglang --writes double_buffer`` in front of SGLang at
    TP 2 (the in-place commits at TP 2: the tests above)."""
    import httpx
    import openai

    from rollpatch.engines.sglang import SglangEngine
    from tests.sidecarworld import World as SidecarWorld
    from tests.sidecarworld import sidecar_process
    from tests.test_sglang_sidecar import Labelled

    server, root = tp_server
    world = SidecarWorld(tmp_path / "world", root / "model", seed=29, versions=9)
    labelled = Labelled()
    extra = ("--writes", "double_buffer")
    with sidecar_process(world.board, "sglang", server.url, tmp_path, *extra) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120)
        for p in range(len(PROMPTS)):
            labelled.add(p, *_complete(client, world.model, p, min_version=world.latest, wait_s=60))
        for _ in range(3):
            v = world.publish()
            for p in range(len(PROMPTS)):
                labelled.add(p, *_complete(client, world.model, p, min_version=v, wait_s=120))
                assert labelled.spans[-1] == (v, v)
        assert httpx.get(f"{url}/version", timeout=5).json()["served"] == world.latest
    assert sorted(labelled.by_version) == list(range(world.latest - 3, world.latest + 1))
    engine = SglangEngine(server.url)  # the sidecar's gone: its control sockets may be taken
    try:
        assert engine.held(fresh=True)[1] == world.views[world.latest].digest()
        assert engine.weight_version() == str(world.latest)
    finally:
        engine.close()
    check = vllm_env.hf_checker(root / "model")  # HF transformers on each labelled version
    exact = total = 0
    for v, seen in labelled.by_version.items():
        for p, body in seen:
            c = body["choices"][0]
            out = (list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]])
            assert len(out[0]) == 8
            exact += check(world.views[v], [PROMPTS[p]], [out])
            total += len(out[0])
    assert exact >= 0.9 * total, (exact, total)
