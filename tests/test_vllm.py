"""vLLM as a rollout engine.

Offline (no vLLM needed): the layout arithmetic against vLLM's weight loaders at TP 1/2/4,
commits over tensor-parallel ranks simulated with threads and a barrier all-gather, the
decoded-patch file. Live: a stock vLLM server (the venv from ``scripts/vllm-env``) patched in
place over a sequence of versions, compared with Hugging Face transformers.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.vllm import VllmEngine, layout
from rollpatch.engines.vllm.layout import ParamSpec, Shard
from rollpatch.engines.vllm.transfer import read_decoded, write_decoded
from rollpatch.engines.vllm.weights import RuntimeWeights
from rollpatch.errors import (
    BaseMismatchError,
    EngineError,
    PatchDecodeError,
    PatchError,
    TargetMismatchError,
)
from rollpatch.formats import cast_view
from rollpatch.io.safetensors import load_view
from rollpatch.kinds import get_kind
from rollpatch.patch import DeltaOp, Patch, TensorPatch, decode, diff, encode
from rollpatch.view import View
from tests import live_servers, vllm_env

TPS = [(1, 2), (2, 2), (4, 2), (4, 4), (2, 1)]


@pytest.mark.parametrize(("tp", "kv_heads"), TPS)
def test_layout_matches_vllm_loaders(tp: int, kv_heads: int) -> None:
    specs = vllm_env.layer_specs(tp, kv_heads)
    ck = vllm_env.checkpoint(kv_heads=kv_heads)
    assert set(layout.check_coverage(specs, tp)) == set(ck)
    rng = np.random.default_rng(tp)
    loaded = [vllm_env.vllm_load(ck, tp, r, kv_heads) for r in range(tp)]
    for spec in specs:
        shape = layout.param_shape(spec, tp)
        for r in range(tp):
            arr = loaded[r][spec.param].reshape(shape)
            for pl in layout.placements(spec, r, tp):
                src = ck[pl.name].reshape(-1)
                pos = np.unique(rng.integers(0, src.size, 500))
                held, off = layout.locate(pl, pos)
                assert np.array_equal(arr.reshape(-1)[off], src[pos[held]])
        for i, sh in enumerate(spec.shards):
            per_rank = [layout.placements(spec, r, tp)[i] for r in range(tp)]
            params = [loaded[r][spec.param].reshape(shape) for r in range(tp)]
            assert np.array_equal(layout.assemble(per_rank, params), ck[sh.name].reshape(-1))
            everything = np.arange(ck[sh.name].size)  # held by 1 rank, or by each replica
            owners = sum(layout.locate(pl, everything)[0].astype(int) for pl in per_rank)
            want = tp if spec.kind == "replicated" else sh.replicas
            assert np.all(owners == want), (sh.name, tp)


def test_layout_refuses_bad_specs() -> None:
    with pytest.raises(EngineError, match="divide"):
        layout.param_shape(ParamSpec("w", "row", (Shard("w", (4, 6)),)), 4)
    with pytest.raises(EngineError, match="per-rank"):
        layout.param_shape(ParamSpec("w", "column", (Shard("w", (8, 4), 3),)), 2)
    with pytest.raises(EngineError, match="mapped twice"):
        layout.check_coverage(
            [
                ParamSpec("a", "replicated", (Shard("x", (2,)),)),
                ParamSpec("b", "replicated", (Shard("x", (2,)),)),
            ],
            1,
        )
    with pytest.raises(EngineError, match="fuse"):
        ParamSpec("w", "row", (Shard("a", (2, 2)), Shard("b", (2, 2))))


def test_storage_offsets_on_strided_arrays() -> None:
    base = np.arange(7 * 11, dtype=np.int64).reshape(7, 11)
    for arr in (base, base.T, base[1:6:2, ::3], base.T[::2]):
        flat = np.arange(arr.size)
        elem = [s // arr.itemsize for s in arr.strides]
        off = layout.storage_offsets(flat, arr.shape, elem)
        start = (arr.ctypes.data - base.ctypes.data) // arr.itemsize
        assert np.array_equal(base.reshape(-1)[start + off], arr.reshape(-1))


@pytest.mark.parametrize(("tp", "strided"), [(1, False), (1, True), (2, False), (4, True)])
def test_commit_and_load_across_ranks(tp: int, strided: bool) -> None:
    ck0, ck1 = vllm_env.checkpoint(), vllm_env.random_step(vllm_env.checkpoint(), 1)
    v0, v1 = vllm_env.words_view(ck0), vllm_env.words_view(ck1)
    ranks = vllm_env.SimulatedRanks(ck0, tp, strided)
    assert ranks.run(lambda w: w.root()) == [v0.digest()] * tp
    patch = diff(v0, v1)
    got = ranks.run(lambda w: w.commit(patch))
    assert all(isinstance(g, dict) for g in got), got
    assert ranks.run(lambda w: w.root()) == [v1.digest()] * tp
    for r in range(tp):
        for spec in vllm_env.layer_specs(tp):
            want = vllm_env.vllm_load(ck1, tp, r)[spec.param].reshape(layout.param_shape(spec, tp))
            assert np.array_equal(ranks.params[r][spec.param], want), (r, spec.param)
    assert ranks.repacked and "qkv_proj.weight" in ranks.repacked[0]
    assert ranks.run(lambda w: w.load(v0)) == [v0.digest()] * tp
    assert ranks.run(lambda w: w.root()) == [v0.digest()] * tp


def test_failed_commit_restores_every_rank() -> None:
    ck0 = vllm_env.checkpoint()
    v0, v1 = vllm_env.words_view(ck0), vllm_env.words_view(vllm_env.random_step(ck0, 2))
    ranks = vllm_env.SimulatedRanks(ck0, 2)
    good = diff(v0, v1)
    name = "o_proj.weight"
    tp = good.tensors[name]
    bad_new = tp.changes().new.copy()
    bad_new[-1] ^= 1  # written, then caught by the target digest
    bad = Patch(
        good.base,
        good.target,
        {
            **good.tensors,
            name: TensorPatch(
                name,
                tp.kind,
                tp.shape,
                tp.base_digest,
                tp.target_digest,
                DeltaOp(tp.changes().positions, tp.changes().old, bad_new),
            ),
        },
    )
    out = ranks.run(lambda w: w.commit(bad))
    assert all(isinstance(e, TargetMismatchError) for e in out), out
    assert ranks.run(lambda w: w.root()) == [v0.digest()] * 2
    assert ranks.run(lambda w: w.digests(fresh=True)) == [v0.tensor_digests()] * 2
    out = ranks.run(lambda w: w.commit(diff(v1, v0)))  # not on that base
    assert all(isinstance(e, BaseMismatchError) for e in out)
    ranks.repacked.clear()
    oob = Patch(
        good.base,
        good.target,
        {
            name: TensorPatch(
                name,
                tp.kind,
                tp.shape,
                tp.base_digest,
                tp.target_digest,
                DeltaOp(
                    tp.changes().positions + vllm_env.HID * vllm_env.HEADS * vllm_env.HD,
                    tp.changes().old,
                    tp.changes().new,
                ),
            )
        },
    )  # type: ignore
    out = ranks.run(lambda w: w.commit(oob))
    assert all(isinstance(e, PatchError) for e in out) and ranks.repacked == []


def test_decoded_file_roundtrip_and_hostile(tmp_path: pytest.TempPathFactory) -> None:
    ck0 = vllm_env.checkpoint()
    v0, v1 = vllm_env.words_view(ck0), vllm_env.words_view(vllm_env.random_step(ck0, 3))
    patch = diff(v0, v1)
    path = tmp_path / "p.bin"  # type: ignore[operator]
    write_decoded(patch, path)
    assert read_decoded(path).equals(patch)
    raw = path.read_bytes()
    for bad in (
        raw[:-1],
        raw[:100],
        b"\x00" * 16,
        raw.replace(b"delta", b"drop!", 1),
        raw.replace(b"t0.new", b"t0.nex", 1),
    ):
        assert bad != raw
        path.write_bytes(bad)
        with pytest.raises(PatchDecodeError):
            read_decoded(path)


@pytest.mark.parametrize("alias", [True, False])
def test_worker_access_on_torch_parameters(alias: bool) -> None:
    """The worker glue on real torch parameters (one non-contiguous): ``alias`` is the CPU
    path (numpy views), ``alias=False`` the path GPUs take (host copies, torch writes)."""
    torch = pytest.importorskip("torch")
    from rollpatch.engines.vllm.params import TorchParams

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(6, 4).to(torch.bfloat16).requires_grad_(False)
    model.tw = torch.nn.Parameter(
        torch.randn(5, 3).to(torch.bfloat16).t(), requires_grad=False
    )  # (3, 5), column-major storage
    calls: list[object] = []

    def repack(mod: Any, remove_weight: bool) -> None:  # as vLLM's: a kernel from the weight
        calls.append((mod, remove_weight))
        mod.cpu_linear = ("kernel", mod.weight.detach().view(torch.int16).clone())

    model.lin._rollpatch_repack = repack
    model.lin._rollpatch_owns = True  # the stand-in kernel holds its own copy of the words
    specs = [
        ParamSpec(n, "replicated", (Shard(n, tuple(p.shape)),)) for n, p in model.named_parameters()
    ]
    kinds = {s.param: get_kind("bf16") for s in specs}
    w = RuntimeWeights(specs, kinds, TorchParams(model, 1, alias=alias).access())

    def words(p: object) -> np.ndarray:
        return p.detach().view(torch.int16).numpy().view(np.uint16).copy()  # type: ignore

    v0 = vllm_env.words_view({n: words(p) for n, p in model.named_parameters()})
    assert w.root() == v0.digest()
    v1 = vllm_env.words_view({n: words(p) for n, p in model.named_parameters()})
    for n in v1:
        v1[n].data[::2] ^= 0x0101
        v1.invalidate(n)
    w.commit(diff(v0, v1))
    for n, p in model.named_parameters():
        assert np.array_equal(words(p).reshape(-1), v1[n].data), n
    # CPU: the kernel is built while staging from a copy with the new words, swapped in under
    # the pause; elsewhere (no prebuild) it is rebuilt from the written weight in the pause
    assert len(calls) == 1 and calls[0][1] is False
    assert (calls[0][0] is model.lin) is (not alias)
    assert np.array_equal(
        model.lin.cpu_linear[1].numpy().view(np.uint16).reshape(-1), v1["lin.weight"].data
    )
    assert not model.tw.is_contiguous()
    assert w.load(v0) == v0.digest() and w.digests(fresh=True) == v0.tensor_digests()
    # a kernel that reads the live words (torch's linear on AVX2 hosts) is never rebuilt
    model.lin._rollpatch_owns = False
    calls.clear()
    w.commit(diff(v0, v1))
    assert calls == [] and w.digests(fresh=True) == v1.tensor_digests()


def test_adapter_commit_protocol_offline() -> None:
    """The adapter against a scripted server: call order, version tags, and what it reports
    after failures (previous version when the engine still holds it, else not ready)."""
    v0, v1 = (
        vllm_env.words_view(vllm_env.checkpoint()),
        vllm_env.words_view(vllm_env.random_step(vllm_env.checkpoint(), 4)),
    )
    fake = vllm_env.FakeVllm(v0.digest())
    eng = VllmEngine("http://127.0.0.1:9", transport="weight-transfer")
    eng.http = fake  # type: ignore[assignment]
    with pytest.raises(EngineError, match="no verified version"):
        eng.apply(diff(v0, v1), 1)
    eng.adopt(0, v0.digest())
    fake.script(True, v1.tensor_digests(), v1.digest())
    eng.apply(diff(v0, v1), 1)
    assert (eng.version, eng.digest) == (1, v1.digest())
    assert [c[0] for c in fake.calls[-7:]] == [
        "/pause?mode=keep",
        "/start_weight_update",
        "/update_weights",
        "rollpatch_result",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert fake.calls[-3][1] == {"weight_version": "1"}
    fake.script(False, error={"type": "TargetMismatchError", "message": "undone"})
    with pytest.raises(TargetMismatchError, match="undone"):
        eng.apply(diff(v1, v0), 0)
    assert (eng.version, eng.digest) == (1, v1.digest())  # the engine still holds v1
    assert ("/finish_weight_update", {"weight_version": None}) in fake.calls[-4:]
    fake.script(
        False,
        error={"type": "EngineError", "message": "lost", "context": {"restored": False}},
        root="0" * 64,
    )
    with pytest.raises(EngineError, match="lost"):
        eng.apply(diff(v1, v0), 0)
    assert (eng.version, eng.digest) == (None, None)
    assert ("/update_weight_version", {"new_version": "rollpatch:not-ready"}) in fake.calls


# -- live: a stock vLLM server with the worker extension -------------------------------------

PROMPTS = [
    "What is 12 + 7? The answer is",
    "The policy weights of the engine",
    "ka lo mi ne ru sa ti vo ze po qua rix tem bal dor",
]
N_VERSIONS = 5


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if os.environ.get("ROLLPATCH_SKIP_VLLM") == "1":
        pytest.skip("ROLLPATCH_SKIP_VLLM=1: the live vLLM tests are skipped on request")
    python = vllm_env.vllm_python()
    if python is None:
        pytest.fail(f"no vLLM venv at {vllm_env.venv_dir()}: {vllm_env.BUILD_HINT}", pytrace=False)
    return python


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
    """v0 is the checkpoint; each next version a small random step of FP32 masters (dense
    noise, mostly absorbed by BF16 rounding, as in RL), cast to BF16 with cast_view."""
    v0 = load_view(model_dir / "model.safetensors")
    masters = {n: t.to_array().astype(np.float32) for n, t in v0.items()}
    rng = np.random.default_rng(11)
    out = [v0]
    for _ in range(N_VERSIONS):
        for m in masters.values():
            m += (3e-3 * float(m.std())) * rng.standard_normal(m.shape).astype(np.float32)
        out.append(cast_view(masters, "bf16"))
    return out


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
    back = VllmEngine(server.url, transport="rpc")
    back.adopt(N_VERSIONS, versions[-1].digest())
    for k in range(N_VERSIONS, 0, -1):
        back.apply(patches[k - 1].inverse(), k - 1)
        assert back.digest == versions[k - 1].digest()
        assert server.greedy(model_dir, prompt_ids) == outs[k - 1]  # bit for bit
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
