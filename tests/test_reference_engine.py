"""The reference engine: tiny model, in-place view, patches, OpenAI server, pause/commit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from rollpatch.errors import BaseMismatchError, ConfigError, EngineError, TargetMismatchError
from rollpatch.io.safetensors import save_view
from rollpatch.patch import Patch, diff
from rollpatch.view import Tensor, View

PROMPT = "What is 12 + 7? The answer is"


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    from rollpatch.engines.reference import ReferenceEngine

    threads = torch.get_num_threads()
    eng = ReferenceEngine.from_dir(model_dir, threads=1)  # fastest for a tiny model
    eng.load(eng.runtime.view.copy(), 1)
    yield eng
    eng.close()
    torch.set_num_threads(threads)  # the setting is process-wide


@pytest.fixture(scope="module")
def base(engine: Any) -> View:
    """A private copy of the boot weights (version 1)."""
    return engine.runtime.view.copy()


@pytest.fixture(scope="module")
def target(base: View) -> View:
    """Version 2: ~5% of every tensor's values moved by a few percent, re-rounded to BF16."""
    rng = np.random.default_rng(7)
    out = base.copy()
    for name in out:
        t = out[name]
        vals = t.data.view(ml_dtypes.bfloat16).astype(np.float32)
        pick = rng.random(vals.size) < 0.05
        vals[pick] *= 1 + rng.normal(0, 0.2, int(pick.sum())).astype(np.float32)
        out[name] = Tensor(t.kind, t.shape, vals.astype(ml_dtypes.bfloat16).view(np.uint16))
    return out


@pytest.fixture(scope="module")
def target_dir(model_dir: Path, target: View, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding the target weights (a keyframe is a loadable checkpoint)."""
    out = tmp_path_factory.mktemp("target") / "tiny"
    shutil.copytree(model_dir, out)
    save_view(target, out / "model.safetensors", {"format": "pt"})
    return out


@pytest.fixture()
def restore(engine: Any, base: View) -> Iterator[None]:
    """Put the engine back on version 1 after a test that commits."""
    yield
    engine.runtime.step_hook = None
    engine.resume()
    engine.load(base, 1)


@pytest.fixture(scope="module")
def client(engine: Any) -> Any:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _greedy(runtime: Any, n: int = 24) -> list[tuple[int, float | None, Any]]:
    ids = runtime.tokenizer.encode(PROMPT)
    gen = runtime.generate(ids, max_tokens=n, temperature=0, logprobs=3, ignore_eos=True)
    return [(s.token_id, s.logprob, s.top_logprobs) for s in gen]


# ---- model maker and memory -------------------------------------------------------------


def test_make_tiny_model_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from rollpatch.engines.reference import make_tiny_model

    cfg = AutoConfig.from_pretrained(model_dir)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (2048, 128, 2)
    assert cfg.tie_word_embeddings is False
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == cfg.vocab_size
    assert tok.decode(tok.encode(PROMPT)) == PROMPT
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(chat, str) and chat.endswith("<|assistant|>\n")
    again = make_tiny_model(tmp_path / "again")
    weights = (again / "model.safetensors").read_bytes()
    assert weights == (model_dir / "model.safetensors").read_bytes()
    other = make_tiny_model(tmp_path / "other", seed=1, layers=1)
    assert (other / "model.safetensors").read_bytes() != weights


def test_importing_rollpatch_does_not_import_torch() -> None:
    code = (
        "import sys, rollpatch, rollpatch.engines, rollpatch.engines.reference as r; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
        "assert 'make_tiny_model' in r.__all__"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_view_shares_memory_with_parameters(engine: Any, model_dir: Path) -> None:
    from rollpatch.io.safetensors import load_view

    rt = engine.runtime
    params = rt.model.state_dict(keep_vars=True)
    on_disk = load_view(model_dir / "model.safetensors")
    assert set(rt.view) == set(on_disk) == set(params)  # checkpoint names, no rotary buffers
    assert "lm_head.weight" in rt.view and "model.layers.0.self_attn.q_proj.weight" in rt.view
    for name, t in rt.view.items():
        assert t.kind.name == "bf16" and t.shape == tuple(params[name].shape)
        assert t.data.__array_interface__["data"][0] == params[name].data_ptr()  # no copy
    assert sum(t.nbytes for t in rt.view.values()) == sum(
        p.numel() * p.element_size() for p in params.values()
    )
    w, p = rt.view["lm_head.weight"].data, params["lm_head.weight"].detach().view(torch.int16)
    w[5] ^= 0x0100  # a write through the view is a write to the parameter
    assert int(p.reshape(-1)[5]) & 0xFFFF == int(w[5])
    w[5] ^= 0x0100
    rt.view.invalidate("lm_head.weight")
    assert rt.digest() == on_disk.digest()


# ---- patches in place ---------------------------------------------------------------------


def test_patch_in_place_equals_fresh_target_model(
    engine: Any, base: View, target: View, target_dir: Path, restore: None
) -> None:
    from rollpatch.engines.reference import ReferenceRuntime

    rt = engine.runtime
    fresh = ReferenceRuntime(target_dir, threads=1)
    assert fresh.digest() == target.digest()
    want = _greedy(fresh)
    before = _greedy(rt)
    assert [t for t, _, _ in before] != [t for t, _, _ in want]  # the change is visible
    ptrs = {n: p.data_ptr() for n, p in rt.model.state_dict(keep_vars=True).items()}
    patch = diff(base, target)
    assert 0 < patch.n_changed < 0.1 * sum(t.n_elements for t in base.values())
    engine.apply(patch, 2)
    assert engine.version == 2 and engine.digest == target.digest()
    assert _greedy(rt) == want  # token ids and logprobs, bit for bit
    assert {n: p.data_ptr() for n, p in rt.model.state_dict(keep_vars=True).items()} == ptrs
    engine.apply(patch.inverse(), 1)
    assert engine.digest == base.digest() and _greedy(rt) == before


def test_failed_patches_leave_weights_untouched(engine: Any, base: View, target: View) -> None:
    rt = engine.runtime
    words = {n: t.data.copy() for n, t in rt.view.items()}
    wrong = diff(target, base)  # its base is version 2; the engine holds version 1
    with pytest.raises(BaseMismatchError):
        engine.apply(wrong, 3)
    good = diff(base, target)
    bad = Patch(good.base, "00" * 32, good.tensors)  # right base, wrong target
    with pytest.raises(TargetMismatchError):
        engine.apply(bad, 3)
    assert engine.version == 1
    assert all(np.array_equal(words[n], t.data) for n, t in rt.view.items())
    rt.view.invalidate()
    assert rt.digest() == base.digest()


def test_load_keyframe_checks_layout(engine: Any, base: View, target: View, restore: None) -> None:
    engine.load(target, 5)
    assert engine.version == 5 and engine.digest == target.digest()
    bad, missing = target.copy(), target.copy()
    lm = base["lm_head.weight"]
    bad["lm_head.weight"] = Tensor(lm.kind, (1024, 256), lm.data)
    del missing["lm_head.weight"]
    for view in (bad, missing):
        with pytest.raises(EngineError):
            engine.load(view, 6)
    assert engine.version == 5 and engine.digest == target.digest()


# ---- OpenAI-compatible server -------------------------------------------------------------


def test_completions_with_openai_client(engine: Any, client: Any) -> None:
    rt, want = engine.runtime, _greedy(engine.runtime, 12)
    r = client.completions.create(
        model=rt.model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    c, extra = r.choices[0], r.choices[0].model_extra
    assert extra["token_ids"] == [t for t, _, _ in want]
    assert extra["prompt_token_ids"] == rt.tokenizer.encode(PROMPT)
    assert c.logprobs.token_logprobs == [lp for _, lp, _ in want]
    assert len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) == r.usage.completion_tokens
    assert c.logprobs.text_offset[0] == 0 and c.finish_reason == "length"
    assert all(len(t) <= 3 for t in c.logprobs.top_logprobs)  # 3 unless two pieces decode alike
    assert r.model_extra["rollpatch"] == {"version_start": 1, "version_end": 1}
    assert (
        client.completions.create(
            model=rt.model_name,
            prompt=extra["prompt_token_ids"],
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        == c.text
    )
    chunks = list(
        client.completions.create(
            model=rt.model_name,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    ids = [i for ch in chunks if ch.choices for i in ch.choices[0].model_extra.get("token_ids", [])]
    assert ids == extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].model_extra["rollpatch"] == {"version_start": 1, "version_end": 1}

    text = c.text
    stop = next(ch for ch in text[len(text) // 2 :] if not ch.isspace())
    for stream in (False, True):
        s = client.completions.create(
            model=rt.model_name,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        parts = list(s) if stream else [s]
        assert "".join(p.choices[0].text for p in parts) == text[: text.find(stop)]
        assert parts[-1].choices[0].finish_reason == "stop"


def test_concurrency_disconnects_and_sse_format(engine: Any) -> None:
    url, rt = engine.url, engine.runtime
    want = [t for t, _, _ in _greedy(rt, 20)]

    def one(n: int) -> list[int]:
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={
                "prompt": PROMPT,
                "max_tokens": 14 + 2 * n,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        return list(r.json()["choices"][0]["token_ids"])

    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(one, range(4)))
    assert all(out[n] == want[: 14 + 2 * n] for n in range(4))  # interleaving changes nothing
    body = {
        "prompt": PROMPT,
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up mid-stream
    deadline = time.monotonic() + 10
    while rt.state()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.state()["in_flight"] == 0  # the abandoned generation stopped
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:  # SSE format
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "length" and "rollpatch" in last


def test_chat_with_openai_client(engine: Any, client: Any) -> None:
    rt = engine.runtime
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(
        model=rt.model_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    c = r.choices[0]
    assert len(c.logprobs.content) == 10 and all(
        len(e.top_logprobs) == 2 for e in c.logprobs.content
    )
    assert c.logprobs.content[0].logprob == c.logprobs.content[0].top_logprobs[0].logprob
    assert len(c.model_extra["token_ids"]) == 10 and r.model_extra["prompt_token_ids"]
    assert r.model_extra["rollpatch"] == {"version_start": 1, "version_end": 1}
    assert c.message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=rt.model_name,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert chunks[-1].model_extra["rollpatch"]["version_end"] == 1
    sampled = [
        client.chat.completions.create(
            model=rt.model_name,
            messages=messages,
            max_tokens=8,
            temperature=0.9,
            top_p=0.9,
            seed=11,
            extra_body={"return_token_ids": True},
        )
        .choices[0]
        .model_extra["token_ids"]
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "echo": True}, "echo"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [5, 99_999]}, "prompt"),
        ({"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_bad_completion_requests_are_400(engine: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(engine.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_other_errors_are_json(engine: Any, client: Any) -> None:
    url = engine.url
    r = httpx.post(
        url + "/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400
    r = httpx.get(url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=engine.runtime.model_name,
            max_tokens=2,
            n=3,
            messages=[{"role": "user", "content": "x"}],
        )
    assert [m.id for m in client.models.list().data] == [engine.runtime.model_name]


# ---- pause, resume, commit mid-generation ---------------------------------------------


def test_pause_holds_generation_and_commit_changes_version(
    engine: Any, client: Any, base: View, target: View, restore: None
) -> None:
    rt, url = engine.runtime, engine.url
    reached, go = threading.Event(), threading.Event()

    def hook(i: int) -> None:
        if i == 3:
            reached.set()
            go.wait(10)

    rt.step_hook = hook
    chunks: list[Any] = []
    worker = threading.Thread(
        target=lambda: chunks.extend(
            client.completions.create(
                model=rt.model_name,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        )
    )
    worker.start()
    assert reached.wait(30)
    state = httpx.post(url + "/rollpatch/pause", timeout=30).json()
    assert state["paused"] is True and state["forwards_in_flight"] == 0
    go.set()
    held = rt.tokens_generated
    time.sleep(0.3)
    state = httpx.get(url + "/rollpatch/state", timeout=30).json()
    assert rt.tokens_generated == held and state["in_flight"] == 1 and worker.is_alive()
    engine.apply(diff(base, target), 2)  # commit while paused
    assert httpx.get(url + "/rollpatch/state", timeout=30).json()["version"] == 2
    httpx.post(url + "/rollpatch/resume", timeout=30)
    worker.join(30)
    assert len([i for ch in chunks for i in ch.choices[0].model_extra.get("token_ids", [])]) == 12
    assert chunks[-1].model_extra["rollpatch"] == {"version_start": 1, "version_end": 2}


def test_pause_drains_and_resume_continues(engine: Any) -> None:
    rt = engine.runtime
    started = threading.Event()
    rt.step_hook = lambda i: started.set()
    out: list[Any] = []
    ids = rt.tokenizer.encode(PROMPT)
    worker = threading.Thread(
        target=lambda: out.extend(rt.generate(ids, max_tokens=300, temperature=0, ignore_eos=True))
    )
    try:
        worker.start()
        assert started.wait(30)
        assert rt.pause(timeout=30)
        held = rt.tokens_generated
        time.sleep(0.2)
        assert rt.tokens_generated == held and rt.state()["forwards_in_flight"] == 0
    finally:
        rt.resume()
        rt.step_hook = None
    worker.join(60)
    assert len(out) == 300


# ---- staged commits and the background audit (issue 10) -------------------------------


def test_stage_while_serving_then_commit_only_writes(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """Staging proves the target digests from the changed words alone, while generation runs;
    the commit writes, reads back, and leaves digests that a full re-hash confirms."""
    from rollpatch.follower.commit import CommitGate

    rt = engine.runtime
    patch = diff(base, target)
    ids = rt.tokenizer.encode(PROMPT)
    gen = rt.generate(ids, max_tokens=40, temperature=0, ignore_eos=True)
    next(gen)  # a generation is in flight and keeps stepping while we stage
    staged = engine.stage(patch, 2)
    assert list(gen) and engine.version == 1  # staging wrote nothing
    assert set(staged.digests) == set(patch.tensors) and staged.target == target.digest()
    assert staged.changed == patch.n_changed and staged.nbytes == 12 * staged.changed
    gate = CommitGate(engine, "pause")
    gate.run(lambda: engine.commit_staged(staged, 2))
    assert engine.version == 2 and engine.digest == target.digest()
    assert gate.last is not None and gate.last.pause_s == gate.last_pause_s
    fresh = View({n: t for n, t in rt.view.items()})  # no cached digests: a full re-hash
    assert fresh.digest() == target.digest()
    with pytest.raises(BaseMismatchError):  # staged against version 1: refused on version 2
        engine.commit_staged(staged, 3)
    assert engine.version == 2


def test_commit_whose_write_check_fails_leaves_every_word_in_place(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """A word changed behind the digests after staging (the last tensor written): the
    commit's old-word check refuses it and nothing of the update stays written. As in the
    vLLM worker, the rollback writes the held version's words over every staged position
    of the tensors it started, the one changed behind the digests included."""
    rt = engine.runtime
    staged = engine.stage(diff(base, target), 2)
    names = list(staged.tensors)
    victim = names[-1]
    before = {n: rt.view[n].data.copy() for n in rt.view}
    pos = int(staged.tensors[victim].positions[0])
    rt.view[victim].data[pos] ^= 1  # behind the cached digests: the base check still passes
    with pytest.raises(BaseMismatchError):
        engine.commit_staged(staged, 2)
    assert engine.version == 1
    assert all(np.array_equal(rt.view[n].data, before[n]) for n in before)


def test_stage_encoded_chain_in_place_while_serving(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """A chain of two published steps is decoded into one copy per touched tensor while a
    generation runs (rollpatch.engines.catchup: nothing written, the decoder's changes prove
    the targets), then committed; a full re-hash confirms the target."""
    from rollpatch.engines.staged import EncodedStep
    from rollpatch.patch import encode

    full = diff(base, target)
    mid = View({n: t.copy() for n, t in base.items()})
    for name, tp in full.tensors.items():
        mid[name].data[tp.changes().positions[::2]] = tp.changes().new[
            ::2
        ]  # half of the change, then the rest
        mid.invalidate(name)
    steps = [
        EncodedStep((encode(diff(a, b), a),), a.digest(), b.digest())
        for a, b in ((base, mid), (mid, target))
    ]
    rt = engine.runtime
    gen = rt.generate(rt.tokenizer.encode(PROMPT), max_tokens=40, temperature=0, ignore_eos=True)
    next(gen)
    staged = engine.stage_encoded(steps, 2)
    assert list(gen) and engine.version == 1 and engine.digest == base.digest()
    assert staged is not None and staged.target == target.digest()
    assert staged.changed == full.n_changed  # the composed change, not the two steps' sum
    assert staged.digests == engine.stage(full, 2).digests
    engine.commit_staged(staged, 2)
    assert View({n: t for n, t in rt.view.items()}).digest() == target.digest()
    with pytest.raises(BaseMismatchError):  # the chain no longer starts at the held version
        engine.stage_encoded(steps, 3)


def test_double_buffered_commit_exchanges_storage(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """``writes="double_buffer"``: staging builds each touched tensor's new storage (the live
    weights untouched, generation running), the commit exchanges it for the parameters' in
    O(1): the model computes exactly what the in-place commit computes, the view aliases the
    new storage (a full re-hash = target), and a failed exchange puts the old storage back."""
    from rollpatch.engines.reference import ReferenceEngine
    from rollpatch.engines.staged import EncodedStep
    from rollpatch.patch import encode

    rt = engine.runtime
    engine.apply(diff(base, target), 2)
    want = _greedy(rt)
    engine.load(base, 1)
    double = ReferenceEngine(rt, serve_http=False, writes="double_buffer")
    ptrs = {n: p.data_ptr() for n, p in rt.model.named_parameters()}
    gen = rt.generate(rt.tokenizer.encode(PROMPT), max_tokens=20, temperature=0, ignore_eos=True)
    next(gen)
    step = EncodedStep((encode(diff(base, target), base),), base.digest(), target.digest())
    staged = double.stage_encoded([step], 2)
    assert staged is not None and set(staged.payload["buffers"]) == set(staged.tensors)
    assert list(gen) and rt.view.digest() == base.digest()  # nothing written while staging
    double.commit_staged(staged, 2)
    assert _greedy(rt) == want
    moved = [n for n, p in rt.model.named_parameters() if p.data_ptr() != ptrs[n]]
    assert moved and all(
        rt.view[n].data.__array_interface__["data"][0] == p.data_ptr()
        for n, p in rt.model.named_parameters()
        if n in rt.view
    )
    rt.view.invalidate()
    assert rt.view.digest() == target.digest()
    staged = double.stage(diff(target, base), 1)
    name = next(iter(staged.payload["buffers"]))
    staged.payload["buffers"]["no.such.tensor"] = staged.payload["buffers"][name]
    with pytest.raises(EngineError):
        double.commit_staged(staged, 1)
    assert rt.view.digest() == target.digest() and engine.version == 2
    with pytest.raises(ConfigError):
        ReferenceEngine(rt, serve_http=False, writes="both")  # type: ignore[arg-type]


def test_stage_refuses_a_patch_that_would_miss_its_target(
    engine: Any, base: View, target: View
) -> None:
    from rollpatch.patch import DeltaOp, TensorPatch

    patch = diff(base, target)
    name = min(patch.tensors)
    tp = patch.tensors[name]
    bad_new = tp.changes().new.copy()
    bad_new[0] ^= 1
    bad = Patch(
        patch.base,
        patch.target,
        {
            **patch.tensors,
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
    with pytest.raises(TargetMismatchError):
        engine.stage(bad, 2)
    assert engine.version == 1 and engine.digest == base.digest()


@pytest.mark.parametrize("slice_", [1 << 16, 3])
def test_sum_delta_matches_a_full_hash(monkeypatch: pytest.MonkeyPatch, slice_: int) -> None:
    """The O(changed) sum change equals a full re-hash, also when it is summed in slices
    (3 positions: slices end between 8-byte words, never inside one)."""
    from rollpatch.engines import staged
    from rollpatch.engines.staged import sum_delta
    from rollpatch.view import sum128

    monkeypatch.setattr(staged, "_SUM_SLICE", slice_)
    rng = np.random.default_rng(3)
    m = (1 << 64) - 1
    for dtype, n in (
        (np.uint16, 1),
        (np.uint16, 1003),
        (np.uint32, 77),
        (np.uint8, 13),
        (np.uint64, 9),
        (np.uint8, 4000),
    ):
        a = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype)
        pos = np.unique(rng.integers(0, n, max(1, n // 4))).astype(np.int64)
        new = rng.integers(0, np.iinfo(dtype).max, pos.size, dtype=dtype)
        s, d = sum128(a), sum_delta(a, pos, new)
        b = a.copy()
        b[pos] = new
        assert ((s[0] + d[0]) & m, (s[1] + d[1]) & m) == sum128(b)


def test_audit_finds_a_flipped_bit_and_the_sidecar_resyncs(model_dir: Path, tmp_path: Path) -> None:
    """Flip one bit of a live weight behind the sidecar's back: the audit finds it within its
    period, /ready answers 503 (out of rotation), and the follower re-syncs from a keyframe
    by itself, back on a verified version whose full re-hash is the published digest."""
    from rollpatch.engines.reference import ReferenceEngine
    from rollpatch.follower import FollowerConfig
    from rollpatch.publisher import Publisher, PublisherConfig
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    board = f"file://{tmp_path / 'board'}"
    eng = ReferenceEngine.from_dir(model_dir, threads=1)
    masters = {n: t.to_array().astype(np.float32) for n, t in eng.runtime.view.items()}
    pub = Publisher(board, "r1", PublisherConfig(keyframe_every=4), asynchronous=False)
    for step in range(3):
        if step:
            for m in masters.values():
                m *= np.float32(1.01)
        latest = pub.publish(masters)
    pub.flush()
    period = 0.05
    cfg = SidecarConfig(
        commit_mode="pause",
        follower=FollowerConfig(
            poll_s=0.05, audit_bytes_per_s=64 * 2**20 / period, audit_period_s=period
        ),
    )
    sc = start_sidecar(board, "r1", eng, eng.url, config=cfg)
    try:
        deadline = time.monotonic() + 60
        while sc.sidecar.follower.version != latest:
            assert time.monotonic() < deadline, "never caught up"
            time.sleep(0.02)
        assert httpx.get(sc.url + "/ready").status_code == 200
        name = min(eng.runtime.view)
        seen, loaded = threading.Event(), []
        load = eng.load

        def held_load(view: View, version: int) -> None:  # hold the re-sync until /ready 503
            seen.wait(30)
            loaded.append(version)
            load(view, version)

        eng.load = held_load  # type: ignore[method-assign]
        auditor = sc.sidecar.follower.auditor
        assert auditor is not None
        hashed_before = auditor.bytes
        t0 = time.monotonic()
        with eng.runtime.commit() as view:  # a stray write: nothing updates any digest
            view[name].data[5] ^= np.uint16(1 << 3)
        while httpx.get(sc.url + "/ready").status_code != 503:
            assert time.monotonic() - t0 < 30, "the audit never found the flipped bit"
            time.sleep(0.01)
        hashed = auditor.bytes - hashed_before
        seen.set()
        while not (
            httpx.get(sc.url + "/ready").status_code == 200
            and sc.sidecar.follower.version == latest
        ):
            assert time.monotonic() - t0 < 60, "never came back on a verified version"
            time.sleep(0.02)
        # found within one pass over the model, counted from before the write: the slice
        # running then (which may have read that tensor just before it) adds one more budget,
        # and the pass's last slice may end past the tensor
        assert 0 < hashed <= eng.runtime.view.nbytes + 2 * auditor.budget, hashed
        assert loaded == [latest] and sc.sidecar.follower.status().audits == 1
        fresh = View({n: t for n, t in eng.runtime.view.items()})
        assert fresh.digest() == sc.sidecar.board.manifest("r1", latest).target
        assert httpx.get(sc.url + "/version").json()["audit_mismatches"] == 1
    finally:
        sc.stop()
