"""vLLM at ``--tensor-parallel-size 2``, live (the rank arithmetic offline:
tests/test_vllm_offline.py; SGLang's TP 2: tests/test_sglang_tp_live.py).

One vLLM server for the module (the venv from ``scripts/vllm-env``; two CPU workers, one core
each, bound by :func:`rollpatch.engines.vllm.launch.cpu_binding`; the engine-core hook and
``ROLLPATCH_FAULT_INJECTION=1``), booted from version 0 of the live tests' tiny Llama. Every
checkpoint tensor read is an all-gather of the ranks' blocks (as bytes: vLLM's CPU
shared-memory all-gather and NCCL take no int16).

- **versions**: the adapter verifies the booted weights from both ranks; patches through the
  official weight-update routes (decoded in both workers), a staged chain of three composed
  in the workers and committed in one engine-core call, a keyframe loaded in place, inverse
  patches back to v0 over ``collective_rpc``. After each: both ranks re-hash to the published
  digests, ``weight_version`` names the version, and the greedy tokens and logprobs agree with
  Hugging Face transformers on that version's weights; the keyframe serves what the chain
  served and v0 serves what the fresh server served, bit for bit. A tampered patch is refused
  with the engine serving its last good version;
- **the audit**: one bit flipped behind the digests on rank 1 only is found, the adapter
  reports no version, and a keyframe brings it back;
- **a partial-rank failure**: rank 1's check fails mid-commit (a word the staged update
  overwrites, changed behind the digests on rank 1 only) after rank 0 wrote: the commit is
  refused, and the adapter never names a version over the mixed words;
- **keep and double-buffered commits**: ``kv_on_commit="keep"`` commits at TP 2; a
  double-buffered commit (TP 1 only) is refused before anything is written;
- **the sidecar** (``rollpatch sidecar --engine vllm``, its own process) joins a run through
  patches and follows it; every labelled response is what that version's keyframe answers.

Without the venv the module is SKIPPED, loudly.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollpatch.engines.staged import EncodedStep
from rollpatch.engines.vllm import VllmEngine
from rollpatch.errors import BaseMismatchError, EngineError, PatchDecodeError
from rollpatch.patch import diff, encode
from rollpatch.view import View
from tests import vllm_env

N_VERSIONS = 6
PROMPTS = [[1, 5, 9, 200, 31, 7], [1, 77, 300, 12], [1, 1500, 3, 3, 90]]
#: Rank 1's rows of ``gate_proj`` (256-511 of 512: the second half of the column-parallel
#: ``gate_up_proj``'s gate block; its kernel holds its own words: written after the pause).
GATE = "model.layers.1.mlp.gate_proj.weight"
RANK1_ROWS = (256, 512)
#: Rank 1's rows of the embedding (1024-2047 of the vocabulary: written in the pause).
EMBED = "model.embed_tokens.weight"
RANK1_VOCAB = (1024, 2048)

Served = tuple[vllm_env.Server, Path]


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from tests import live_servers

    python = vllm_env.vllm_python()
    if python is None:
        pytest.skip(
            f"SKIPPED LIVE vLLM TP TEST: no vLLM venv at {vllm_env.venv_dir()}: "
            f"{vllm_env.BUILD_HINT}"
        )
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED LIVE vLLM TP TEST: --tensor-parallel-size 2 needs 2 cores here")
    pytest.importorskip("transformers")
    from rollpatch.engines.reference import make_tiny_model

    root = tmp_path_factory.mktemp("vllm-tp")
    with contextlib.redirect_stderr(io.StringIO()):
        make_tiny_model(root / "model", **live_servers.LIVE_MODEL)
    srv = vllm_env.start_server(
        python,
        root / "model",
        root / "vllm.log",
        extra=["--weight-transfer-config", '{"backend": "rollpatch"}'],
        env={"ROLLPATCH_FAULT_INJECTION": "1"},
        tp=2,
    )
    try:
        srv.wait_ready(400)
        yield srv, root / "model"
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def versions(tp_server: Served) -> list[View]:
    """v0 is the checkpoint; each next version a small random step (vllm_env.random_versions)."""
    return vllm_env.random_versions(tp_server[1], N_VERSIONS, seed=23)


@pytest.fixture(scope="module")
def engine(tp_server: Served, versions: list[View]) -> Iterator[VllmEngine]:
    eng = VllmEngine(tp_server[0].url)
    eng.adopt(0, versions[0].digest())
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_check(tp_server: Served) -> Callable[[View, list[list[int]], vllm_env.Outputs], int]:
    pytest.importorskip("torch")
    return vllm_env.hf_checker(tp_server[1])


def _step(vs: list[View], a: int, b: int) -> EncodedStep:
    return EncodedStep((encode(diff(vs[a], vs[b]), vs[a]),), vs[a].digest(), vs[b].digest())


def _rank1_change(
    vs: list[View], a: int, b: int, name: str = GATE, rows: tuple[int, int] = RANK1_ROWS
) -> int:
    """A position of ``name`` that the patch ``a -> b`` changes, in rank 1's ``rows``."""
    pos = diff(vs[a], vs[b]).tensors[name].changes().positions
    cols = vs[a][name].shape[1]
    mine = pos[(pos >= rows[0] * cols) & (pos < rows[1] * cols)]
    assert mine.size, f"the patch changes nothing of rank 1's rows of {name}"
    return int(mine[mine.size // 2])


def _flip(srv: vllm_env.Server, name: str, position: int) -> list[int]:
    """Flip the lowest bit of one word behind every digest; each rank's count of flips."""
    out = srv.post("/collective_rpc", {"method": "rollpatch_flip", "args": [name, str(position)]})
    assert all(r["ok"] for r in out["results"]), out
    return [int(r["flipped"]) for r in out["results"]]


def test_live_tp2_versions_forward_back_and_refusals(
    tp_server: Served, engine: VllmEngine, versions: list[View], hf_check: Callable
) -> None:
    srv, model = tp_server
    info = engine.info()
    assert info["tp"] == 2 and info["atomic_commit"]
    assert info["background_staging"]  # its gathers on a group of its own (tpgather)
    assert sorted(info["tensors"]) == sorted(versions[0])
    assert engine.held(fresh=True) == (versions[0].tensor_digests(), versions[0].digest())
    outs0 = srv.greedy(model, PROMPTS)
    n_tokens = sum(len(t) for t, _ in outs0)
    assert hf_check(versions[0], PROMPTS, outs0) >= n_tokens - 2

    def served(k: int) -> vllm_env.Outputs:
        assert (engine.version, engine.digest) == (k, versions[k].digest())
        assert engine.held(fresh=True) == (versions[k].tensor_digests(), versions[k].digest())
        assert srv.get("/weight_info") == {"weight_version": str(k)}
        got = srv.greedy(model, PROMPTS)
        assert hf_check(versions[k], PROMPTS, got) >= n_tokens - 2
        return got

    outs: dict[int, vllm_env.Outputs] = {0: outs0}
    for k in (1, 2):  # the official routes, decoded in both workers
        engine.apply_encoded(encode(diff(versions[k - 1], versions[k]), versions[k - 1]), k)
        outs[k] = served(k)
    assert outs[2] != outs[0]  # the writes reach both ranks' kernels

    # three steps composed in the workers, committed in one engine-core call
    staged = engine.stage_encoded([_step(versions, k - 1, k) for k in (3, 4, 5)], 5)
    engine.commit_staged(staged, 5)
    assert engine.last_timings["core_ms"] > 0  # the hook's one call, not a pause round trip
    outs[5] = served(5)

    # a tampered patch: refused before anything is written, v5 still served
    blob = bytearray(encode(diff(versions[5], versions[6]), versions[5]))
    blob[len(blob) // 2] ^= 0x10
    with pytest.raises(PatchDecodeError):
        engine.apply_encoded(bytes(blob), 6)
    assert engine.held(fresh=True)[1] == versions[5].digest()
    assert srv.greedy(model, PROMPTS) == outs[5]
    # the staged commit's kernels (built while staging, swapped in under the hold) compute
    # what kernels packed from a keyframe of the same version compute, bit for bit
    engine.load(versions[5], 5)
    assert srv.greedy(model, PROMPTS) == outs[5]

    engine.load(versions[2], 2)  # a keyframe in place serves what the chain served
    assert engine.held(fresh=True)[1] == versions[2].digest()
    assert srv.greedy(model, PROMPTS) == outs[2]

    engine.release()  # one adapter drives the engine at a time (engines/ownership.py)
    back = VllmEngine(srv.url, transport="rpc")
    try:
        back.adopt(2, versions[2].digest())
        for k in (2, 1):
            back.apply(diff(versions[k - 1], versions[k]).inverse(), k - 1)
            assert back.held(fresh=True)[1] == versions[k - 1].digest()
    finally:
        back.close()
    assert srv.greedy(model, PROMPTS) == outs[0]  # bit for bit what the fresh server served
    engine.adopt(0, versions[0].digest())


def test_live_tp2_audit_finds_a_bit_flipped_on_rank_1(
    tp_server: Served, engine: VllmEngine, versions: list[View]
) -> None:
    srv, model = tp_server
    engine.load(versions[0], 0)
    before = srv.greedy(model, PROMPTS)
    clean = engine.audit(1 << 30)
    assert clean.wrapped and not clean.mismatched and clean.tensors == len(versions[0])
    cols = versions[0][GATE].shape[1]
    assert _flip(srv, GATE, (RANK1_ROWS[0] + 3) * cols + 5) == [0, 1]  # rank 1's block only
    found = engine.audit(1 << 30)
    assert found.mismatched == (GATE,)
    assert engine.version is None and engine.digest is None
    assert srv.get("/weight_info") == {"weight_version": "rollpatch:not-ready"}
    with pytest.raises(EngineError, match="no verified version"):
        engine.apply_encoded(encode(diff(versions[0], versions[1]), versions[0]), 1)
    engine.load(versions[0], 0)  # a keyframe re-syncs both ranks
    assert engine.held(fresh=True)[1] == versions[0].digest()
    assert not engine.audit(1 << 30).mismatched
    assert srv.greedy(model, PROMPTS) == before


def test_live_tp2_partial_rank_failure_is_undone_on_every_rank(
    tp_server: Served, engine: VllmEngine, versions: list[View]
) -> None:
    """Rank 1's old-word check fails mid-commit (a word the update overwrites in the pause,
    changed behind the digests on rank 1 only) after rank 0 wrote: the commit is refused and
    rank 0 puts its old words back, so both ranks hold the previous version and the adapter
    still names it. Once in the engine-core hook's atomic commit (inside its hold), once under
    ``/pause`` as without the hook (the adapter asks the ranks, still paused). A weight served
    only by its packed kernel is written after the pause: there the kernel (built from the
    checked words while staging) serves the version, and the failed write taints the engine
    until a keyframe."""
    srv, model = tp_server
    engine.load(versions[0], 0)
    before = srv.greedy(model, PROMPTS)
    position = _rank1_change(versions, 0, 1, EMBED, RANK1_VOCAB)

    staged = engine.stage_encoded([_step(versions, 0, 1)], 1)
    assert _flip(srv, EMBED, position) == [0, 1]  # behind rank 1's digests only
    with pytest.raises(BaseMismatchError) as err:
        engine.commit_staged(staged, 1)
    assert err.value.context["rank"] == 1 and err.value.context["undone_ranks"] == "[0]"
    assert (engine.version, engine.digest) == (0, versions[0].digest())
    assert srv.get("/weight_info") == {"weight_version": "0"}
    # rank 1's failed write put every word it started back to the update's old words (the
    # flipped one too) and re-packed: both ranks hold v0 exactly
    assert engine.held(fresh=True) == (versions[0].tensor_digests(), versions[0].digest())
    assert srv.greedy(model, PROMPTS) == before

    engine.release()  # one adapter drives the engine at a time (engines/ownership.py)
    paused = VllmEngine(srv.url, transport="rpc")
    paused._atomic = False  # as a server started without --scheduler-cls: under /pause
    try:
        paused.adopt(0, versions[0].digest())
        staged = paused.stage_encoded([_step(versions, 0, 1)], 1)
        assert _flip(srv, EMBED, position) == [0, 1]
        with pytest.raises(BaseMismatchError):
            paused.commit_staged(staged, 1)
        assert (paused.version, paused.digest) == (0, versions[0].digest())
    finally:
        paused.close()
    assert engine.version is None  # released: what it verified is void until set again
    engine.adopt(0, versions[0].digest())
    assert engine.held(fresh=True) == (versions[0].tensor_digests(), versions[0].digest())
    assert srv.get("/weight_info") == {"weight_version": "0"}
    assert srv.greedy(model, PROMPTS) == before

    engine.commit_staged(engine.stage_encoded([_step(versions, 0, 1)], 1), 1)  # now it commits
    served = srv.greedy(model, PROMPTS)
    engine.load(versions[0], 0)
    staged = engine.stage_encoded([_step(versions, 0, 1)], 1)
    assert _flip(srv, GATE, _rank1_change(versions, 0, 1)) == [0, 1]
    if not engine.info()["kernel_only_modules"]:
        # a CPU where vLLM packs no kernel (no oneDNN BF16 matmul, e.g. AVX2 only: it serves
        # torch's linear from the plain words): the gate's words are checked in the pause like
        # any other, the commit is refused and undone on both ranks
        with pytest.raises(BaseMismatchError) as err:
            engine.commit_staged(staged, 1)
        assert err.value.context["rank"] == 1
        assert (engine.version, engine.digest) == (0, versions[0].digest())
        assert engine.held(fresh=True) == (versions[0].tensor_digests(), versions[0].digest())
        assert srv.greedy(model, PROMPTS) == before
        return
    engine.commit_staged(staged, 1)  # a kernel-only weight: its kernel was built from the
    # checked words
    assert srv.greedy(model, PROMPTS) == served
    settled = srv.post("/collective_rpc", {"method": "rollpatch_settled", "args": []})
    assert [bool(r["tainted"]) for r in settled["results"]] == [False, True]
    assert engine.held(fresh=True)[1] != versions[1].digest()  # rank 1's words: not v1
    assert engine.audit(1 << 30).mismatched and engine.version is None  # out of rotation
    engine.load(versions[0], 0)
    assert engine.held(fresh=True)[1] == versions[0].digest()
    assert srv.greedy(model, PROMPTS) == before


def test_live_tp2_keep_and_double_buffered_commits(
    tp_server: Served, engine: VllmEngine, versions: list[View]
) -> None:
    """A ``keep`` commit at TP 2, and one staged inline on the engine loop, serve what a
    ``recompute`` commit staged in a thread serves; a double-buffered commit (TP 1 only) is
    refused before anything is staged."""
    srv, model = tp_server
    engine.load(versions[0], 0)
    engine.commit_staged(engine.stage_encoded([_step(versions, 0, 1)], 1), 1)
    recomputed = srv.greedy(model, PROMPTS)
    engine.release()  # one adapter drives the engine at a time (engines/ownership.py)
    keep = VllmEngine(srv.url, kv_on_commit="keep")
    try:
        keep.load(versions[0], 0)
        keep.commit_staged(keep.stage_encoded([_step(versions, 0, 1)], 1), 1)
        assert keep.kv_across_commit == "keep"
        assert keep.held(fresh=True)[1] == versions[1].digest()
        assert srv.greedy(model, PROMPTS) == recomputed
    finally:
        keep.close()
    inline = VllmEngine(srv.url, staging="inline")  # staged on the engine loop
    try:
        inline.load(versions[0], 0)
        inline.commit_staged(inline.stage_encoded([_step(versions, 0, 1)], 1), 1)
        assert inline.held(fresh=True)[1] == versions[1].digest()
        assert srv.greedy(model, PROMPTS) == recomputed
    finally:
        inline.close()
    double = VllmEngine(srv.url, transport="rpc", writes="double_buffer")
    try:
        double.adopt(1, versions[1].digest())
        with pytest.raises(EngineError, match="double-buffered commits need the CPU at TP = 1"):
            double.stage_encoded([_step(versions, 1, 2)], 2)
        assert (double.version, double.held(fresh=True)[1]) == (1, versions[1].digest())
    finally:
        double.close()
    engine.load(versions[0], 0)


def test_live_tp2_sidecar_follows_and_labels_every_response(
    tp_server: Served, engine: VllmEngine, versions: list[View], tmp_path: Path
) -> None:
    """``rollpatch sidecar --engine vllm`` (its own process, the follower staging in both
    workers while vLLM serves, its auditor gathering beside the staging) in front of vLLM at
    TP 2 booted on v0: it joins a run at version 5 through patches and follows three more;
    every response is labelled, and each labelled body equals, field for field, what the same
    server answers with that version's keyframe loaded (tests/test_vllm_sidecar.py's check)."""
    import httpx

    from tests.sidecarworld import BOOT_LATEST, World, sidecar_process
    from tests.test_vllm_sidecar import PROMPTS as ASK
    from tests.test_vllm_sidecar import Labelled, _client, _complete, check_labels

    srv, model = tp_server
    engine.load(versions[0], 0)
    world = World(tmp_path / "world", model, seed=29, versions=BOOT_LATEST + 5)
    labelled = Labelled()
    with sidecar_process(world.board, "vllm", srv.url, tmp_path) as url:
        assert httpx.get(f"{url}/version", timeout=5).json()["served"] == BOOT_LATEST
        client = _client(url)
        for p in range(len(ASK)):
            labelled.add(p, *_complete(client, world, p))
        for _ in range(3):
            v = world.publish()
            for p in range(len(ASK)):
                labelled.add(p, *_complete(client, world, p, min_version=v, wait_s=120))
                assert labelled.spans[-1] == (v, v)
        assert srv.get("/weight_info") == {"weight_version": str(world.latest)}
    assert sorted(labelled.by_version) == list(range(BOOT_LATEST, world.latest + 1))
    check_labels(srv.url, world, labelled)
    engine.load(versions[0], 0)
