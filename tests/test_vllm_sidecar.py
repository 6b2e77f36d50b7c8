"""vLLM behind the sidecar, and the follower's encoded path (engines that decode themselves).

Offline (no vLLM): the follower hands a single-step plan's patch objects to an engine that
decodes them itself (:meth:`EngineAdapter.commit_encoded`, or an adapter's single-object
``commit_encoded``, such as VllmEngine) and decodes against ``words()`` otherwise; a replica
whose engine booted on an older version reports no version until it has caught up.

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
import shutil
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.engines import ViewEngine
from rollpatch.errors import BaseMismatchError
from rollpatch.follower import Follower, FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.patch import Patch, apply, decode
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import ObjectInfo, Store
from rollpatch.view import View
from tests import vllm_env

RUN = "rl"
FAST = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=60.0)


# -- offline: the follower's encoded path ------------------------------------------------------

class SelfDecoding(ViewEngine):
    """Decodes wire-format patches itself (as an out-of-process engine would in its workers)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[tuple[int, int]] = []  # (objects, version) per commit_encoded
        self.words_calls = 0

    def words(self) -> Any:
        self.words_calls += 1
        return super().words()

    def decodes_itself(self, n_objects: int) -> bool:
        return True

    def commit_encoded(self, blobs: Sequence[bytes], base_digest: str, target_digest: str,
                       version: int) -> bool:
        view = self.view
        if view.digest() != base_digest:
            raise BaseMismatchError("not on the patch's base", engine=self.name)
        parts = [decode(b, view, check_base=False) for b in blobs]
        apply(view, Patch(base_digest, target_digest,
                          {n: t for p in parts for n, t in p.tensors.items()}, {}))
        self.encoded.append((len(blobs), version))
        self._version = version
        return True


class SingleObject(ViewEngine):
    """VllmEngine's shape: decodes one unsharded patch object itself, declines sharded steps."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[int] = []
        self.words_calls = 0

    def words(self) -> Any:
        self.words_calls += 1
        return super().words()

    def decodes_itself(self, n_objects: int) -> bool:
        return n_objects == 1

    def commit_encoded(self, blobs: Sequence[bytes], base_digest: str, target_digest: str,
                       version: int) -> bool:
        if len(blobs) != 1:
            return False
        apply(self.view, decode(blobs[0], self.view))  # checks the base root, verifies targets
        self.encoded.append(version)
        self._version = version
        return True


def _masters(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f"layers.{i}.w": (rng.standard_normal((32, 64)) * 0.02).astype(np.float32)
            for i in range(4)}


def _step(masters: Mapping[str, np.ndarray], rng: np.random.Generator
          ) -> dict[str, np.ndarray]:
    return {n: m + (0.01 * float(m.std()) * rng.standard_normal(m.shape)).astype(np.float32)
            for n, m in masters.items()}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[View]]:
    """Versions 0..4 of a small run (one keyframe at 0, step patches) on a file:// board."""
    rng = np.random.default_rng(5)
    board = f"file://{tmp_path_factory.mktemp('encoded') / 'board'}"
    pub = Publisher(board, RUN, PublisherConfig(keyframe_every=0, skip_strides=()),
                    asynchronous=False)
    masters, views = _masters(rng), []
    for _ in range(5):
        pub.publish(masters)
        views.append(cast_view(masters, "bf16"))
        masters = _step(masters, rng)
    pub.close()
    return board, views


@pytest.mark.parametrize("kind", [SelfDecoding, SingleObject])
def test_single_steps_go_to_engines_that_decode(small_run: tuple[str, list[View]],
                                                kind: type[ViewEngine]) -> None:
    board, views = small_run
    engine = kind()
    engine.load(views[0].copy(), 0)
    f = Follower(board, RUN, engine, FAST)
    assert f.sync(1) == 1 and engine.digest == views[1].digest()
    assert engine.words_calls == 0  # type: ignore[attr-defined]
    assert engine.encoded in ([(1, 1)], [1])  # type: ignore[attr-defined]
    assert f.sync(3) == 3 and engine.digest == views[3].digest()  # two steps: decoded here
    assert engine.words_calls == 1 and len(engine.encoded) == 1  # type: ignore[attr-defined]
    assert f.status().commits == 2


def test_sharded_step_goes_whole_or_is_decoded() -> None:
    """A 2-shard step: every shard's object to an engine that takes several; decoded for an
    adapter that takes one object only (its blob binds a shard's digests, not the view's)."""
    from tests.test_follower import _build  # the follower tests' run: v21 has 2 patch shards

    pub = _build(21, None, 0)
    for kind, words in ((SelfDecoding, 0), (SingleObject, 1)):
        engine = kind()
        engine.load(pub.views[20].copy(), 20)
        assert Follower(Board(pub.store), "rl", engine, FAST).sync(21) == 21
        assert engine.digest == pub.views[21].digest() and engine.words_calls == words
    assert isinstance(engine, SingleObject) and engine.encoded == []


class GatedStore(Store):
    """Objects wait for ``open`` (to hold a catch-up half-way)."""

    writable = False

    def __init__(self, inner: Store) -> None:
        self.inner, self.uri = inner, inner.uri
        self.open = threading.Event()

    def _get(self, key: str) -> bytes:
        if "/objects/" in key:
            self.open.wait(30)
        return self.inner.get(key)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def _list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def _head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        raise AssertionError("read-only")

    def _delete(self, key: str) -> None:
        raise AssertionError("read-only")

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        raise AssertionError("read-only")


def test_an_older_engine_is_not_ready_until_caught_up(small_run: tuple[str, list[View]]
                                                      ) -> None:
    board, views = small_run
    gated = GatedStore(Board(board).store)
    engine = ViewEngine()
    engine.load(views[0].copy(), 0)  # booted from an older keyframe: verified, but behind
    f = Follower(Board(gated), RUN, engine, FAST)
    f.start()
    try:
        time.sleep(0.3)
        assert f.version is None and f.status().version is None  # catching up: not ready
        gated.open.set()
        assert f.wait_for(4, 30) and f.version == 4
    finally:
        f.stop()


# -- live: a real vLLM behind the sidecar -------------------------------------------------------

PROMPTS = ["What is 12 + 7? The answer is", "ka lo mi ne ru sa ti vo ze po"]
MAX_TOKENS = 8
LONG = 400            # tokens of a generation that spans a commit (max-model-len 512)
BOOT_LATEST = 5       # published before the joining replica starts (it boots on version 0)
N_VERSIONS = 20       # views prepared; the tests publish more as they go


class World:
    """The tiny model, its versions (FP32 masters plus small noise, as an RL step), a board."""

    def __init__(self, root: Path) -> None:
        from rollpatch.engines.reference import make_tiny_model
        from rollpatch.io.safetensors import load_view, save_view

        tiny = make_tiny_model(root / "tiny", hidden_size=256, heads=4, kv_heads=2,
                               intermediate=512, vocab_size=2048)
        masters = {n: t.to_array().astype(np.float32)
                   for n, t in load_view(tiny / "model.safetensors").items()}
        rng = np.random.default_rng(11)
        self.masters: list[dict[str, np.ndarray]] = []
        for _ in range(N_VERSIONS):
            self.masters.append({n: m.copy() for n, m in masters.items()})
            for m in masters.values():
                m += (3e-3 * float(m.std())) * rng.standard_normal(m.shape).astype(np.float32)
        self.views = [cast_view(m, "bf16") for m in self.masters]
        # the model directory vLLM boots from: version 0's view (an older keyframe)
        self.model = root / "boot"
        self.model.mkdir()
        for p in tiny.iterdir():
            if p.suffix != ".safetensors":
                shutil.copy(p, self.model / p.name)
        save_view(self.views[0], self.model / "model.safetensors")
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(self.board, RUN, PublisherConfig(keyframe_every=0,
                                                                    skip_strides=()),
                                   asynchronous=False)
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
        pytest.fail(f"no vLLM venv at {vllm_env.venv_dir()}: {vllm_env.BUILD_HINT}",
                    pytrace=False)
    return python


@pytest.fixture(scope="module")
def world(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> World:
    pytest.importorskip("transformers")
    pytest.importorskip("openai")
    return World(tmp_path_factory.mktemp("vllm-sidecar"))


@pytest.fixture(scope="module")
def server(vllm_python: Path, world: World) -> Iterator[vllm_env.Server]:
    srv = vllm_env.start_server(vllm_python, world.model, world.model.parent / "vllm.log",
                                extra=["--weight-transfer-config", '{"backend": "rollpatch"}'])
    try:
        srv.wait_ready(300)
        srv.post("/v1/completions", {"model": str(world.model), "prompt": "warm up",
                                     "max_tokens": 2}, timeout=300)  # first request compiles
        yield srv
    finally:
        srv.stop()


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client: Any, world: World, prompt: int, **rollpatch: Any
              ) -> tuple[dict[str, Any], dict[str, str]]:
    """One greedy completion; the raw JSON body and the headers."""
    extra: dict[str, Any] = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    if rollpatch:
        extra["rollpatch"] = rollpatch
    raw = client.completions.with_raw_response.create(
        model=str(world.model), prompt=PROMPTS[prompt], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=1, extra_body=extra)
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
    wanted = {w for v in labelled.by_version for w in (v - 1, v, v + 1)
              if 0 <= w <= world.latest}
    try:
        for v in sorted(wanted):
            engine.load(world.views[v], v)
            answers[v] = [_strip(_complete(client, world, p)[0]) for p in range(len(PROMPTS))]
    finally:
        engine.close()
    for v, seen in labelled.by_version.items():
        for prompt, body in seen:
            assert "rollpatch" in body
            assert _strip(body, "rollpatch") == answers[v][prompt], \
                f"a response labelled {v} is not what version {v} answers"
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
    sc = start_sidecar(world.board, RUN, engine, url,
                       config=SidecarConfig(commit_mode="drain", follower=FAST))
    try:
        polls = []
        deadline = time.monotonic() + 120
        while (r := httpx.get(f"{sc.url}/ready")).status_code != 200:
            assert r.status_code == 503, r.text
            polls.append(httpx.get(f"{sc.url}/version").json()["served"])
            assert time.monotonic() < deadline, "the joining replica never became ready"
            time.sleep(0.02)
        assert None in polls and set(polls) <= {None, BOOT_LATEST}, \
            f"ready (or serving) before it had caught up: {polls}"
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


def _long_stream(url: str, world: World, chunks: list[dict[str, Any]],
                 first: threading.Event, out: dict[str, Any]) -> None:
    """A streamed greedy generation of ``LONG`` tokens through the sidecar (in a thread)."""
    import httpx

    body = {"model": str(world.model), "prompt": PROMPTS[1], "max_tokens": LONG,
            "temperature": 0, "logprobs": 1, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "stream": True}
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
    answers between commits are checked against the versions."""
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import make_engine, start_sidecar

    engine, url = make_engine("vllm", engine_url=server.url)
    have = world.latest
    engine.load(world.views[have], have)  # the label checks left the server elsewhere
    sc = start_sidecar(world.board, RUN, engine, url,
                       config=SidecarConfig(commit_mode="pause", follower=FAST))
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
            assert label in ({"version_start": v - 1, "version_end": v},
                             {"version_start": v - 1, "version_end": v - 1}), label
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
    """The follower gives vLLM a single step undecoded (decoded in the workers, nothing but
    the patch crosses processes); a multi-step plan is decoded against words()."""
    from rollpatch.engines.vllm import VllmEngine

    engine = _count_words(VllmEngine(server.url))
    engine.load(world.views[world.latest], world.latest)  # the label checks moved the server
    f = Follower(world.board, RUN, engine, FAST)
    try:
        v = world.publish()
        assert f.sync() == v and engine.words_calls == 0
        assert engine.held(fresh=True) == (world.views[v].tensor_digests(),
                                           world.views[v].digest())
        assert server.get("/weight_info") == {"weight_version": str(v)}
        world.publish()
        v = world.publish()
        assert f.sync() == v and engine.words_calls == 1
        assert engine.held(fresh=True)[1] == world.views[v].digest()
    finally:
        engine.close()
