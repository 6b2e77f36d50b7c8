"""vLLM as a rollout engine, live: a stock vLLM server (the venv from ``scripts/vllm-env``)
with the worker extension, patched in place over a sequence of versions and compared with
Hugging Face transformers. The offline arithmetic and protocol: tests/test_vllm_offline.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from rollpatch.engines.vllm import VllmEngine
from rollpatch.errors import (
    BaseMismatchError,
    PatchDecodeError,
    PatchError,
    TargetMismatchError,
)
from rollpatch.patch import DeltaOp, Patch, TensorPatch, decode, diff, encode
from rollpatch.view import View
from tests import live_servers, vllm_env

# -- live: a stock vLLM server with the worker extension -------------------------------------

PROMPTS = [
    "What is 12 + 7? The answer is",
    "The policy weights of the engine",
    "ka lo mi ne ru sa ti vo ze po qua rix tem bal dor",
]
N_VERSIONS = 5


@pytest.fixture(scope="module")
def server(vllm_python: Path, live_vllm: live_servers.SharedServer) -> Iterator[vllm_env.Server]:
    """The session's vLLM server (tests.live_servers: the live tiny model, the worker extension,
    the rollpatch weight-transfer backend, warmed up), holding the model's weights."""
    pytest.importorskip("transformers")
    srv = live_vllm.acquire()
    yield srv
    live_vllm.release()


@pytest.fixture(scope="module")
def model_dir(server: vllm_env.Server, live_vllm: live_servers.SharedServer) -> Path:
    """The model the server booted from (make_tiny_model with live_servers.LIVE_MODEL)."""
    return live_vllm.model


@pytest.fixture(scope="module")
def versions(model_dir: Path) -> list[View]:
    """v0 is the checkpoint; each next version a small random step (vllm_env.random_versions)."""
    return vllm_env.random_versions(model_dir, N_VERSIONS, seed=11)


@pytest.fixture(scope="module")
def engine(server: vllm_env.Server, versions: list[View]) -> Iterator[VllmEngine]:
    eng = VllmEngine(server.url)
    # booted from the v0 checkpoint (a fresh vLLM, or one an earlier module used, reset to it
    # by a verified keyframe load: tests.live_servers)
    eng.adopt(0, versions[0].digest())
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_check(model_dir: Path) -> Callable[[View, list[list[int]], vllm_env.Outputs], int]:
    pytest.importorskip("torch")
    return vllm_env.hf_checker(model_dir)


def test_vllm_sequence_of_versions(
    engine: VllmEngine,
    server: vllm_env.Server,
    model_dir: Path,
    versions: list[View],
    prompt_ids: list[list[int]],
    hf_check: Callable,
) -> None:
    """v0 → v5 by encoded patches (official weight-update routes, decoded in the worker), then
    v5 → v0 by inverse decoded patches (collective_rpc): digests, HF agreement, exact reversal."""
    assert engine.transport == "weight-transfer"
    info = engine.info()
    assert info["tp"] == 1 and info["aliases"] and sorted(info["tensors"]) == sorted(versions[0])
    assert info["packed_modules"] >= 4 * 2 + 1  # qkv, o, gate_up, down per layer; lm_head
    # kernels holding their own copy of the words (rebuilt after writes) depend on the CPU:
    # oneDNN/SGL packs on AVX-512 BF16 hosts, torch's linear on the plain weight elsewhere;
    # never the embedding (its lookup reads the plain weight) among the kernel-only ones
    assert info["kernel_only_modules"] <= info["owning_modules"] <= info["packed_modules"]
    assert info["kernel_only_modules"] < info["packed_modules"]
    outs = [server.greedy(model_dir, prompt_ids)]
    n_tokens = sum(len(t) for t, _ in outs[0])
    assert hf_check(versions[0], prompt_ids, outs[0]) >= n_tokens - 2
    patches = [diff(a, b) for a, b in itertools.pairwise(versions)]
    for k, p in enumerate(patches, start=1):
        assert 0 < p.n_changed < sum(t.n_elements for t in versions[k].values())
        engine.apply_encoded(encode(p, versions[k - 1]), k)
        assert (engine.version, engine.digest) == (k, versions[k].digest())
        assert engine.held(fresh=True) == (versions[k].tensor_digests(), versions[k].digest())
        assert server.get("/weight_info") == {"weight_version": str(k)}
        outs.append(server.greedy(model_dir, prompt_ids))
        assert hf_check(versions[k], prompt_ids, outs[k]) >= n_tokens - 2
    assert outs[-1] != outs[0]  # the writes reach what vLLM computes (packed weights rebuilt)
    engine.release()  # one adapter drives the engine at a time (engines/ownership.py)
    back = VllmEngine(server.url, transport="rpc")
    try:
        back.adopt(N_VERSIONS, versions[-1].digest())
        for k in range(N_VERSIONS, 0, -1):
            back.apply(patches[k - 1].inverse(), k - 1)
            assert back.digest == versions[k - 1].digest()
            assert server.greedy(model_dir, prompt_ids) == outs[k - 1]  # bit for bit
    finally:
        back.close()
    engine.adopt(0, versions[0].digest())


def test_vllm_double_buffered_commits(
    engine: VllmEngine,
    server: vllm_env.Server,
    model_dir: Path,
    versions: list[View],
    prompt_ids: list[list[int]],
) -> None:
    """``writes="double_buffer"``: staged commits that exchange each touched parameter's
    storage serve bit-identically to the in-place commits of the same versions (one step
    and a composed catch-up), the workers' re-hash equals the published digests, and the
    in-place path works on the exchanged storage afterwards."""
    from rollpatch.engines.staged import EncodedStep

    def step(a: int, b: int) -> EncodedStep:
        blob = encode(diff(versions[a], versions[b]), versions[a])
        return EncodedStep((blob,), versions[a].digest(), versions[b].digest())

    engine.load(versions[0], 0)
    inplace = {}
    for k in (1, 2, 3):
        engine.commit_staged(engine.stage_encoded([step(k - 1, k)], k), k)
        inplace[k] = server.greedy(model_dir, prompt_ids)
    double = VllmEngine(server.url, transport="rpc", writes="double_buffer")
    try:
        engine.load(versions[0], 0)
        engine.release()  # one adapter drives the engine at a time (engines/ownership.py)
        double.adopt(0, versions[0].digest())
        double.commit_staged(double.stage_encoded([step(0, 1)], 1), 1)
        assert double.held(fresh=True) == (versions[1].tensor_digests(), versions[1].digest())
        assert server.greedy(model_dir, prompt_ids) == inplace[1]
        double.commit_staged(double.stage_encoded([step(1, 2), step(2, 3)], 3), 3)
        assert double.held(fresh=True)[1] == versions[3].digest()
        assert server.greedy(model_dir, prompt_ids) == inplace[3]
    finally:
        double.close()
    engine.adopt(3, versions[3].digest())
    engine.commit_staged(engine.stage_encoded([step(3, 2)], 2), 2)  # in place, new storage
    assert engine.held(fresh=True)[1] == versions[2].digest()
    assert server.greedy(model_dir, prompt_ids) == inplace[2]
    engine.load(versions[0], 0)


def test_vllm_keyframe_load_equals_patched(
    engine: VllmEngine,
    server: vllm_env.Server,
    model_dir: Path,
    versions: list[View],
    prompt_ids: list[list[int]],
) -> None:
    """A keyframe loaded in place serves exactly what the patch chain serves."""
    engine.load(versions[3], 3)
    assert (engine.version, engine.held(fresh=True)[1]) == (3, versions[3].digest())
    assert server.get("/weight_info") == {"weight_version": "3"}
    loaded = server.greedy(model_dir, prompt_ids)
    engine.load(versions[2], 2)
    engine.apply_encoded(encode(diff(versions[2], versions[3]), versions[2]), 3)
    assert server.greedy(model_dir, prompt_ids) == loaded
    engine.load(versions[0], 0)
    assert engine.digest == versions[0].digest()


def test_vllm_refuses_bad_patches_and_keeps_serving(
    engine: VllmEngine,
    server: vllm_env.Server,
    model_dir: Path,
    versions: list[View],
    prompt_ids: list[list[int]],
) -> None:
    v1, v2, v3 = versions[1:4]
    engine.load(v1, 1)
    before = server.greedy(model_dir, prompt_ids)
    good = diff(v1, v2)

    def unchanged() -> None:
        assert (engine.version, engine.digest) == (1, v1.digest())
        assert engine.held(fresh=True) == (v1.tensor_digests(), v1.digest())
        assert server.get("/weight_info") == {"weight_version": "1"}
        assert server.greedy(model_dir, prompt_ids) == before

    blob = bytearray(encode(good, v1))
    blob[-7] ^= 0x5A  # payload bytes: the per-tensor checksum catches it
    with pytest.raises(PatchDecodeError, match="checksum"):
        engine.apply_encoded(bytes(blob), 2)
    unchanged()
    name = "model.layers.1.mlp.down_proj.weight"
    tp = good.tensors[name]
    wrong = tp.changes().new.copy()
    wrong[0] ^= 0x0100  # written in place, caught by the target digest, undone
    for bad_tp, err in (
        (
            TensorPatch(
                name,
                tp.kind,
                tp.shape,
                tp.base_digest,
                tp.target_digest,
                DeltaOp(tp.changes().positions, tp.changes().old, wrong),
            ),
            TargetMismatchError,
        ),
        (
            TensorPatch(
                name,
                tp.kind,
                tp.shape,
                tp.base_digest,
                tp.target_digest,
                DeltaOp(tp.changes().positions + (1 << 20), tp.changes().old, tp.changes().new),
            ),
            PatchError,
        ),
    ):
        with pytest.raises(err):
            engine.apply(Patch(good.base, good.target, {**good.tensors, name: bad_tp}), 2)
        unchanged()
    with pytest.raises(BaseMismatchError):
        engine.apply_encoded(encode(diff(v2, v3), v2), 3)
    unchanged()
    engine.apply(good, 2)
    assert engine.held(fresh=True)[1] == v2.digest()


def test_vllm_words_are_the_held_tensors(engine: VllmEngine, versions: list[View]) -> None:
    """words(): the adapter-side decode context, fetched tensor by tensor from the workers."""
    engine.load(versions[4], 4)
    words = engine.words()
    assert "lm_head.weight" in words and "nope" not in words
    for name in (
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        assert np.array_equal(words[name].data, versions[4][name].data)
    blob = encode(diff(versions[4], versions[5]), versions[4])
    assert decode(blob, words).equals(decode(blob, versions[4]))
    with pytest.raises(BaseMismatchError):
        engine.adopt(4, versions[5].digest())
    assert engine.version == 4
