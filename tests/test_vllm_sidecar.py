"""vLLM behind the sidecar (the follower's encoded path offline: tests/test_follower_encoded.py).

Live (the venv from ``scripts/vllm-env``; one vLLM server for the whole module, booted from
version 0's view saved as its model directory): an elastic join (the sidecar is not ready
until the follower has patched vLLM up to LATEST), both commit modes over versions published
while serving, every response labelled in body and headers, and every label checked against
the outputs of the same server set to that version (the whole JSON body, so a mislabelled
response, or any field vLLM returns altered in passing, fails). vLLM 0.32's OpenAI routes carry
no ``weight_versions`` (only its token-in/token-out API does), so none is there to pass
through; vLLM's own tag (``GET /weight_info``) is checked to name the served version.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.view import View
from tests import live_servers, vllm_env

RUN = "rl"
FAST = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=60.0)


# -- live: a real vLLM behind the sidecar -------------------------------------------------------

PROMPTS = ["What is 12 + 7? The answer is", "ka lo mi ne ru sa ti vo ze po"]
MAX_TOKENS = 8
LONG = 400  # tokens of a generation that spans a commit (max-model-len 512)
BOOT_LATEST = 5  # published before the joining replica starts (it boots on version 0)
N_VERSIONS = 20  # views prepared; the tests publish more as they go


class World:
    """The tiny model, its versions (FP32 masters plus small noise, as an RL step), a board."""

    def __init__(self, root: Path, boot: Path) -> None:
        from rollpatch.io.safetensors import load_view

        masters = {
            n: t.to_array().astype(np.float32)
            for n, t in load_view(boot / "model.safetensors").items()
        }
        rng = np.random.default_rng(11)
        self.masters: list[dict[str, np.ndarray]] = []
        for _ in range(N_VERSIONS):
            self.masters.append({n: m.copy() for n, m in masters.items()})
            for m in masters.values():
                m += (3e-3 * float(m.std())) * rng.standard_normal(m.shape).astype(np.float32)
        self.views = [cast_view(m, "bf16") for m in self.masters]
        # the model directory vLLM booted from holds version 0's view (an older keyframe)
        self.model = boot
        assert load_view(boot / "model.safetensors").digest() == self.views[0].digest()
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(
            self.board, RUN, PublisherConfig(keyframe_every=0, skip_strides=()), asynchronous=False
        )
        self.latest = -1
        self.lock = threading.Lock()
        while self.latest < BOOT_LATEST:
            self.publish()

    def publish(self) -> int:
        with self.lock:
            v = self.publisher.publish(self.masters[self.latest + 1])
            assert v == self.latest + 1
            self.latest = v
            return v


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
    """The session's vLLM server (tests.live_servers: started with ROLLPATCH_FAULT_INJECTION=1
    for rollpatch_flip, the audit test's fault), holding the live tiny model's weights."""
    pytest.importorskip("transformers")
    pytest.importorskip("openai")
    srv = live_vllm.acquire()
    yield srv
    live_vllm.release()


@pytest.fixture(scope="module")
def world(
    server: vllm_env.Server,
    live_vllm: live_servers.SharedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> World:
    return World(tmp_path_factory.mktemp("vllm-sidecar"), live_vllm.model)


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(
    client: Any, world: World, prompt: int, **rollpatch: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    """One greedy completion; the raw JSON body and the headers."""
    extra: dict[str, Any] = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    if rollpatch:
        extra["rollpatch"] = rollpatch
    raw = client.completions.with_raw_response.create(
        model=str(world.model),
        prompt=PROMPTS[prompt],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body=extra,
    )
    return raw.http_response.json(), {k.lower(): v for k, v in raw.headers.items()}


class Labelled:
    """Responses through the sidecar: (prompt, body) by the version that labels them."""

    def __init__(self) -> None:
        self.by_version: dict[int, list[tuple[int, dict[str, Any]]]] = {}
        self.spans: list[tuple[int, int]] = []

    def add(self, prompt: int, body: dict[str, Any], headers: Mapping[str, str]) -> None:
        """Record one short answer, asked alone (a batch of one, as the check's answers)."""
        rp = body["rollpatch"]
        start, end = rp["version_start"], rp["version_end"]
        assert isinstance(start, int) and isinstance(end, int) and start <= end
        assert headers["x-rollpatch-version-start"] == str(start)
        assert headers["x-rollpatch-version-end"] == str(end)
        self.spans.append((start, end))
        if start == end:
            self.by_version.setdefault(start, []).append((prompt, body))


def _strip(body: Mapping[str, Any], *extra: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created", *extra)}


def check_labels(url: str, world: World, labelled: Labelled) -> None:
    """Set the same server to each labelled version (a keyframe, loaded in place) and ask it
    directly: every labelled body must equal its answer, field for field (except the request
    id and time). Versions next to a label must answer differently, so the check can tell."""
    from rollpatch.engines.vllm import VllmEngine

    engine, client = VllmEngine(url), _client(url)
    answers: dict[int, list[dict[str, Any]]] = {}
    wanted = {w for v in labelled.by_version for w in (v - 1, v, v + 1) if 0 <= w <= world.latest}
    try:
        for v in sorted(wanted):
            engine.load(world.views[v], v)
            answers[v] = [_strip(_complete(client, world, p)[0]) for p in range(len(PROMPTS))]
    finally:
        engine.close()
    for v, seen in labelled.by_version.items():
        for prompt, body in seen:
            assert "rollpatch" in body
            assert _strip(body, "rollpatch") == answers[v][prompt], (
                f"a response labelled {v} is not what version {v} answers"
            )
        for w in (v - 1, v + 1):
            if w in answers:
                assert answers[w] != answers[v], f"versions {v} and {w} answer alike"


def test_elastic_join_then_drain_mode(server: vllm_env.Server, world: World) -> None:
    """vLLM booted from version 0's keyframe joins a run at version 5: the sidecar reports
    not ready until the follower has patched it to LATEST, then serves (drain mode) while
    versions keep coming, every answer labelled with the version that produced it."""
    import httpx

    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import make_engine, start_sidecar

    engine, url = make_engine("vllm", engine_url=server.url)
    engine.adopt(0, world.views[0].digest())  # type: ignore[attr-defined]
    assert Board(world.board).latest(RUN).version == BOOT_LATEST  # type: ignore[union-attr]
    seen, commit = threading.Event(), engine.commit_staged

    def held_commit(staged: Any, version: int) -> None:  # until /ready was seen 503
        seen.wait(60)
        commit(staged, version)

    engine.commit_staged = held_commit  # type: ignore[method-assign]
    sc = start_sidecar(
        world.board, RUN, engine, url, config=SidecarConfig(commit_mode="drain", follower=FAST)
    )
    try:
        polls = []
        deadline = time.monotonic() + 120
        while (r := httpx.get(f"{sc.url}/ready")).status_code != 200:
            assert r.status_code == 503, r.text
            polls.append(httpx.get(f"{sc.url}/version").json()["served"])
            seen.set()
            assert time.monotonic() < deadline, "the joining replica never became ready"
            time.sleep(0.02)
        assert None in polls and set(polls) <= {None, BOOT_LATEST}, (
            f"ready (or serving) before it had caught up: {polls}"
        )
        assert r.json()["version"] == BOOT_LATEST
        assert httpx.get(f"{sc.url}/version").json()["served"] == BOOT_LATEST
        plan = sc.sidecar.follower.last_plan
        assert plan is not None and plan.have == 0 and len(plan.steps) == BOOT_LATEST
        assert not any(s.is_keyframe for s in plan.steps)  # through patches, no keyframe
        st = sc.sidecar.follower.status()
        assert (st.commits, st.reboots) == (1, 0)
        assert engine.digest == world.views[BOOT_LATEST].digest()
        assert server.get("/weight_info") == {"weight_version": str(BOOT_LATEST)}

        client, labelled = _client(sc.url), Labelled()
        for p in range(len(PROMPTS)):
            labelled.add(p, *_complete(client, world, p))
        for _ in range(2):
            v = world.publish()
            labelled.add(0, *_complete(client, world, 0, min_version=v, wait_s=60))
            assert labelled.spans[-1] == (v, v)
            labelled.add(1, *_complete(client, world, 1))
        publisher = threading.Thread(target=world.publish)  # lands between requests
        publisher.start()
        deadline, n = time.monotonic() + 60, 0
        while publisher.is_alive() or sc.sidecar.follower.version != world.latest:
            assert time.monotonic() < deadline, "the sidecar did not catch up"
            n += 1
            labelled.add(n % 2, *_complete(client, world, n % 2))
        publisher.join()
        assert all(s == e for s, e in labelled.spans)  # drain: no answer spans a commit
        assert len(labelled.by_version) >= 3
        assert server.get("/weight_info") == {"weight_version": str(world.latest)}
    finally:
        sc.stop()
    check_labels(server.url, world, labelled)


def _long_stream(
    url: str,
    world: World,
    chunks: list[dict[str, Any]],
    first: threading.Event,
    out: dict[str, Any],
) -> None:
    """A streamed greedy generation of ``LONG`` tokens through the sidecar (in a thread)."""
    import httpx

    body = {
        "model": str(world.model),
        "prompt": PROMPTS[1],
        "max_tokens": LONG,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            out["status"], out["headers"] = r.status_code, dict(r.headers)
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunks.append(json.loads(line[5:]))
                    first.set()
    except BaseException as e:  # noqa: BLE001 - re-raised by the test
        out["error"] = e
    finally:
        first.set()


def test_pause_mode_spans_commits(server: vllm_env.Server, world: World) -> None:
    """Pause mode (vLLM's /pause?mode=keep through the adapter): a generation that has
    streamed tokens survives a commit, finishes, and is labelled with both versions; short
    answers between commits are checked against the versions. Commits here are
    double-buffered (``--writes double_buffer``: storage exchanged under the pause)."""
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import make_engine, start_sidecar

    engine, url = make_engine("vllm", engine_url=server.url, writes="double_buffer")
    have = world.latest
    engine.load(world.views[have], have)  # the label checks left the server elsewhere
    sc = start_sidecar(
        world.board, RUN, engine, url, config=SidecarConfig(commit_mode="pause", follower=FAST)
    )
    labelled = Labelled()
    try:
        client, follower = _client(sc.url), sc.sidecar.follower
        labelled.add(0, *_complete(client, world, 0, min_version=have, wait_s=60))
        spanned = rounds = 0
        while rounds < 2 or (spanned == 0 and rounds < 5):
            rounds += 1
            follower.stop()  # the next version waits until a generation is in flight
            v = world.publish()
            chunks: list[dict[str, Any]] = []
            first, out = threading.Event(), dict[str, Any]()
            t = threading.Thread(target=_long_stream, args=(sc.url, world, chunks, first, out))
            t.start()
            assert first.wait(60) and "error" not in out, out.get("error")
            engine.pause()  # hold it mid-generation (nested: the commit's own pause is inside)
            try:
                before = len(chunks)
                assert follower.sync() == v  # the gate pauses the engine, commits, resumes
            finally:
                engine.resume()
            follower.start()
            t.join(120)
            assert out["status"] == 200 and "error" not in out, out.get("error")
            tokens = [tok for c in chunks for tok in c["choices"][0]["logprobs"]["tokens"]]
            assert len(tokens) == LONG and before > 0  # kept, not aborted
            assert out["headers"]["x-rollpatch-version-start"] == str(v - 1)
            assert "rollpatch" not in chunks[-2]
            # Whether the commit landed mid-generation is the server's to say: chunks counted
            # on the client after the pause may have been generated before it (in flight in
            # the sockets), so the label is checked against the two possible truths, and at
            # least one round must span the commit (below).
            label = chunks[-1]["rollpatch"]
            assert label in (
                {"version_start": v - 1, "version_end": v},
                {"version_start": v - 1, "version_end": v - 1},
            ), label
            spanned += label["version_end"] == v
            labelled.add(0, *_complete(client, world, 0))  # alone again: checked below
            assert labelled.spans[-1] == (v, v)
        assert spanned >= 1, "no commit landed mid-generation in 5 rounds"
        assert sc.sidecar.gate.mode == "pause" and len(sc.sidecar.gate.pauses) >= 2
        assert server.get("/weight_info") == {"weight_version": str(world.latest)}
    finally:
        sc.stop()
    check_labels(server.url, world, labelled)


def _count_words(engine: Any) -> Any:
    """Count ``words()`` calls on a VllmEngine (the decode path's cross-process reads)."""
    engine.words_calls = 0
    words = engine.words

    def counted() -> Any:
        engine.words_calls += 1
        return words()

    engine.words = counted
    return engine


def test_follower_hands_vllm_the_encoded_step(server: vllm_env.Server, world: World) -> None:
    """The follower gives vLLM every step undecoded: the workers decode, compose and prove a
    catch-up of any length while serving (nothing but the patches crosses processes)."""
    from rollpatch.engines.vllm import VllmEngine

    engine = _count_words(VllmEngine(server.url))
    engine.load(world.views[world.latest], world.latest)  # the label checks moved the server
    f = Follower(world.board, RUN, engine, FAST)
    posted: list[str] = []
    post = engine.http.post

    def recorded(path: str, body: Any = None, **kw: Any) -> Any:
        posted.append(path if path != "/collective_rpc" else body["method"])
        return post(path, body, **kw)

    engine.http.post = recorded
    try:
        v = world.publish()
        assert f.sync() == v and engine.words_calls == 0
        # the engine-core hook (launch.SCHEDULER): the write, the tag and the prefix-cache
        # reset are one engine-core call; no /pause, /resume or /reset_prefix_cache around it
        assert engine.pauses_itself and "core_ms" in engine.last_timings
        commit = posted.index("rollpatch_commit_atomic")
        assert not {"/pause?mode=keep", "/resume", "/reset_prefix_cache"} & set(posted[commit:])
        assert (
            f.gate.last is not None and f.gate.last.pause_s * 1e3 >= engine.last_timings["core_ms"]
        )
        assert engine.held(fresh=True) == (world.views[v].tensor_digests(), world.views[v].digest())
        assert server.get("/weight_info") == {"weight_version": str(v)}
        world.publish()
        v = world.publish()
        assert f.sync() == v and engine.words_calls == 0  # two steps, composed in the worker
        assert engine.held(fresh=True)[1] == world.views[v].digest()
        assert f.status().commits == 2 and f.gate.last is not None and f.gate.last.ok
    finally:
        engine.close()


def test_audit_finds_a_flipped_bit_in_vllm(server: vllm_env.Server, world: World) -> None:
    """One bit of a live vLLM weight flipped behind the sidecar's back (the fault-injection
    worker method): the audit finds it within one pass, /ready answers 503, and the follower
    re-syncs from a keyframe by itself, back on a version a full re-hash confirms."""
    import httpx

    from rollpatch.engines.vllm import VllmEngine
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    engine = VllmEngine(server.url)
    engine.load(world.views[world.latest], world.latest)
    period = 0.05
    cfg = FollowerConfig(
        poll_s=0.05,
        backoff_s=0.01,
        timeout_s=60.0,
        audit_bytes_per_s=2 * 2**20 / period,
        audit_period_s=period,
    )
    sc = start_sidecar(
        world.board,
        RUN,
        engine,
        server.url,
        config=SidecarConfig(commit_mode="pause", follower=cfg),
    )
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{sc.url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.02)
        seen, loaded, load = threading.Event(), [], engine.load

        def held_load(view: View, version: int) -> None:  # hold the re-sync until /ready 503
            seen.wait(30)
            loaded.append(version)
            load(view, version)

        engine.load = held_load  # type: ignore[method-assign]
        auditor = sc.sidecar.follower.auditor
        assert auditor is not None
        before = auditor.bytes
        names = sorted(engine.tensors())
        name = names[len(names) // 2]
        out = server.post("/collective_rpc", {"method": "rollpatch_flip", "args": [name, "7"]})
        assert out["results"][0]["ok"] and out["results"][0]["flipped"] == 1
        while httpx.get(f"{sc.url}/ready").status_code != 503:
            assert time.monotonic() < deadline + 60, "the audit never found the flipped bit"
            time.sleep(0.01)
        hashed = auditor.bytes - before
        seen.set()
        while not (
            httpx.get(f"{sc.url}/ready").status_code == 200
            and sc.sidecar.follower.version == world.latest
        ):
            assert time.monotonic() < deadline + 120, "never came back on a verified version"
            time.sleep(0.02)
        model_bytes = world.views[world.latest].nbytes
        # found within one pass over the model, counted from before the flip: the slice in
        # flight then (which may have read that tensor just before it) adds one more budget,
        # and the pass's last slice may end past the tensor
        assert 0 < hashed <= model_bytes + 2 * auditor.budget, hashed
        assert loaded == [world.latest] and sc.sidecar.follower.status().audits == 1
        assert engine.held(fresh=True)[1] == world.views[world.latest].digest()
        assert server.get("/weight_info") == {"weight_version": str(world.latest)}
    finally:
        sc.stop()
