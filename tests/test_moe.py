"""Mixture-of-experts end to end: the built-in engine's routed experts, replayed by HF.

A tiny Qwen3-MoE (8 experts, top-2) is served by the built-in engine behind a real sidecar and
gateway; a trainer publishes versions whose patches touch expert and router weights. For every
version, the ``routed_experts`` a response carries (through the openai client, streaming and
not) must equal the routing that Hugging Face transformers computes when it re-runs the
response's tokens under the labelled version, loaded by transformers itself from a checkpoint
written from the published bits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

import httpx
import openai
import torch

from rollpatch.demo.routing import HFReplay, decode_routed_experts
from rollpatch.engines.reference import ReferenceEngine, ReferenceRuntime, make_tiny_moe_model
from rollpatch.follower import FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.gateway import start_gateway
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import start_sidecar
from rollpatch.view import View

PROMPT = "What is 12 + 7?"
MAX_TOKENS = 8
EXPERTS, TOP_K, LAYERS = 8, 2, 2


def _decode(s: str) -> np.ndarray:
    return decode_routed_experts(s)


def _is_routed(name: str) -> bool:
    return ".mlp.experts." in name or name.endswith(".mlp.gate.weight")


class World:
    """A board whose versions move the router and the experts (and everything else)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = make_tiny_moe_model(
            root / "model", experts=EXPERTS, top_k=TOP_K, layers=LAYERS, seed=0
        )
        base = ReferenceRuntime(self.model, threads=1)
        self.prompt_ids = list(base.tokenizer(PROMPT)["input_ids"])
        self.masters = {n: t.to_array().astype(np.float32) for n, t in base.view.items()}
        del base
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(
            self.board, "moe", PublisherConfig(keyframe_every=8), asynchronous=False
        )
        self.views: dict[int, View] = {}
        self.hf: dict[int, HFReplay] = {}
        self.rng = np.random.default_rng(7)
        self.publish()

    def publish(self) -> int:
        if self.views:
            for m in self.masters.values():
                if m.ndim == 2:
                    m += (0.01 * self.rng.standard_normal(m.shape)).astype(np.float32)
        v = self.publisher.publish(self.masters)
        self.publisher.flush()
        self.views[v] = cast_view(self.masters, "bf16")
        return v

    def hf_routing(self, version: int, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(routing, logits) transformers computes for ``tokens`` under ``version``: a
        checkpoint of the version's bits, loaded by transformers itself (the demo's check)."""
        if version not in self.hf:
            self.hf[version] = HFReplay(
                self.model, self.views[version], self.root / f"hf-v{version}"
            )
        return self.hf[version].run(tokens)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def stack(world: World) -> Any:
    """Built-in engine → sidecar (drain mode) → gateway, all real HTTP servers."""
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    sc = start_sidecar(
        world.board,
        "moe",
        engine,
        engine.url,
        config=SidecarConfig(follower=FollowerConfig(poll_s=0.05)),
    )
    gw = None
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{sc.url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "sidecar never became ready"
            time.sleep(0.05)
        gw = start_gateway([f"island={sc.url}"])
        yield engine, sc, gw
    finally:
        if gw is not None:
            gw.stop()
        sc.stop()


# ---- the model and its view ---------------------------------------------------------------


def test_view_has_checkpoint_names_and_aliases_the_fused_experts(world: World) -> None:
    from safetensors import safe_open

    rt = ReferenceRuntime(world.model, threads=1)
    with safe_open(str(world.model / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert set(rt.view) == keys  # per-expert checkpoint names, as vLLM loads them
        for k in keys:
            want = f.get_tensor(k).view(torch.int16).numpy().view(np.uint16).reshape(-1)
            assert np.array_equal(rt.view[k].data, want), k
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert name in rt.view
    fused = rt.model.model.layers[1].mlp.experts.gate_up_proj
    half = fused.shape[1] // 2
    rt.view[name].data[3] ^= 0x0001  # a write through the view lands in the fused parameter
    assert fused[5, half:].reshape(-1)[3].view(torch.int16).item() & 1 == rt.view[name].data[3] & 1
    assert rt.router is not None and (rt.router.layers, rt.router.top_k) == (LAYERS, TOP_K)


def test_mixtral_names_and_routing(tmp_path: Path) -> None:
    """Another MoE family (Mixtral: ``block_sparse_moe``, experts ``w1/w3/w2``): the view has
    the checkpoint's names and bits, and the recorded routing is transformers' own."""
    from safetensors import safe_open
    from transformers import MixtralConfig, MixtralForCausalLM

    from rollpatch.engines.reference import make_tokenizer

    out = make_tokenizer(tmp_path / "mixtral", vocab_size=512)
    cfg = MixtralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).bfloat16().save_pretrained(out)
    rt = ReferenceRuntime(out, threads=1)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert set(rt.view) == names
        for k in names:
            want = f.get_tensor(k).view(torch.int16).numpy().view(np.uint16).reshape(-1)
            assert np.array_equal(rt.view[k].data, want), k
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in rt.view
    prompt = [5, 17, 99, 3, 250]
    gen = rt.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True)
    tokens = [s.token_id for s in gen]
    rows = gen.routed_experts()
    model = MixtralForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]]), output_router_logits=True)
    want = np.stack(
        [
            torch.topk(torch.softmax(x.float(), -1), 2, -1).indices.numpy()
            for x in logits.router_logits
        ],
        1,
    )
    assert rows is not None and np.array_equal(rows, want)


def test_routing_recorded_in_vllm_shape(world: World) -> None:
    rt = ReferenceRuntime(world.model, threads=1)
    rt.load_view(world.views[min(world.views)], min(world.views))
    gen = rt.generate(world.prompt_ids, max_tokens=5, temperature=0, ignore_eos=True)
    tokens = [s.token_id for s in gen]
    rows = gen.routed_experts()
    assert rows is not None
    assert rows.shape == (len(world.prompt_ids) + len(tokens) - 1, LAYERS, TOP_K)
    assert rows.dtype == np.uint8 and int(rows.max()) < EXPERTS
    assert (np.sort(rows, -1)[..., 0] != np.sort(rows, -1)[..., 1]).all()  # distinct experts
    assert gen.routed_spans() == [{"start": 0, "end": len(rows), "version": min(world.views)}]
    assert np.array_equal(gen.routed_experts(3), rows[3:])


# ---- router replay through the sidecar and the gateway ------------------------------------


def _stream_choice(base_url: str, version: int) -> tuple[dict[str, Any], dict[str, Any]]:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
    last: dict[str, Any] = {}
    rp: dict[str, Any] = {}
    ids: list[int] = []
    for chunk in client.completions.create(
        model="model",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={
            "return_token_ids": True,
            "ignore_eos": True,
            "rollpatch": {"exact_version": version, "wait_s": 60},
        },
    ):
        d = chunk.model_dump()
        for c in d["choices"]:
            ids += c.get("token_ids") or []
            if c.get("finish_reason"):
                last = c
        rp = d.get("rollpatch") or rp
    last["token_ids"] = ids
    return last, rp


def test_routed_experts_replay_under_every_version(stack: Any, world: World) -> None:
    _, sc, gw = stack
    seen: list[np.ndarray] = []
    for round_ in range(4):  # the current version, then 3 more published one by one
        v = max(world.views) if round_ == 0 else world.publish()
        before = world.views.get(v - 1)
        if before is not None:  # the patch into v moves router and expert bits
            moved = {
                n for n, t in world.views[v].items() if not np.array_equal(t.data, before[n].data)
            }
            assert any(".mlp.experts." in n for n in moved) and any(
                n.endswith(".mlp.gate.weight") for n in moved
            )
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=120)
        body = client.completions.create(
            model="model",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={
                "return_token_ids": True,
                "ignore_eos": True,
                "rollpatch": {"exact_version": v, "wait_s": 60},
            },
        ).model_dump()
        rp, choice = body["rollpatch"], body["choices"][0]
        assert rp["version_start"] == rp["version_end"] == v and rp["island"] == "island"
        assert rp["spans"] == [
            {"start": 0, "end": len(world.prompt_ids) + MAX_TOKENS - 1, "version": v}
        ]
        tokens = world.prompt_ids + choice["token_ids"]
        rows = _decode(choice["routed_experts"])
        hf_rows, hf_logits = world.hf_routing(v, tokens[:-1])
        assert rows.shape == hf_rows.shape == (len(tokens) - 1, LAYERS, TOP_K)
        for i in range(len(rows)):  # token by token, every layer, in the router's order
            assert np.array_equal(rows[i], hf_rows[i]), f"version {v}, token {i}"
        # each greedy token is a top logit of transformers' pass too (bf16 logits of a
        # random model tie often; a batched pass may break a tie the other way)
        picked = hf_logits[
            np.arange(len(world.prompt_ids) - 1, len(tokens) - 1), choice["token_ids"]
        ]
        top = hf_logits[len(world.prompt_ids) - 1 :].max(-1)
        assert np.allclose(picked, top, rtol=0, atol=0.02 * np.abs(top).max()), (picked, top)
        # streamed through the gateway: the same routing, on the finish chunk
        last, srp = _stream_choice(f"{gw.url}/v1", v)
        assert last["token_ids"] == choice["token_ids"]
        assert last["routed_experts"] == choice["routed_experts"]  # byte-identical string
        assert srp["version_start"] == srp["version_end"] == v and srp["spans"] == rp["spans"]
        # straight from the sidecar, with the prompt rows skipped (vLLM's field)
        direct = httpx.post(
            f"{sc.url}/v1/completions",
            timeout=120,
            json={
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "routed_experts_prompt_start": len(world.prompt_ids),
                "rollpatch": {"exact_version": v},
            },
        ).json()
        tail = _decode(direct["choices"][0]["routed_experts"])
        assert np.array_equal(tail, rows[len(world.prompt_ids) :])
        assert direct["rollpatch"]["spans"] == [{"start": 0, "end": MAX_TOKENS - 1, "version": v}]
        seen.append(rows)
    assert any(not np.array_equal(seen[0], s) for s in seen[1:]), "routing never changed"


def test_chat_carries_routed_experts(stack: Any, world: World) -> None:
    gw = stack[2]
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=120)
    body = client.chat.completions.create(
        model="model",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ).model_dump()
    rows = _decode(body["choices"][0]["routed_experts"])
    n = len(body["prompt_token_ids"]) + len(body["choices"][0]["token_ids"]) - 1
    assert rows.shape == (n, LAYERS, TOP_K)
    v = body["rollpatch"]["version_start"]
    assert body["rollpatch"]["spans"] == [{"start": 0, "end": n, "version": v}]
    hf_rows, _ = world.hf_routing(
        v, body["prompt_token_ids"] + body["choices"][0]["token_ids"][:-1]
    )
    assert np.array_equal(rows, hf_rows)


def test_bad_prompt_start_is_a_clear_400(stack: Any) -> None:
    gw = stack[2]
    for start in (10_000, -1):
        r = httpx.post(
            f"{gw.url}/v1/completions",
            timeout=60,
            json={"prompt": PROMPT, "max_tokens": 2, "routed_experts_prompt_start": start},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "routed_experts_prompt_start" in json.dumps(err) and "Traceback" not in r.text
