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
import threading
import time
from collections.abc import Mapping
from typing import Any

from rollpatch.board import Board
from tests import vllm_env
from tests.sidecarworld import (
    ADOPT,
    BOOT_LATEST,
    FAST,
    RUN,
    World,
    server,
    world,
)

_FIXTURES = (server, world)  # used by name

PROMPTS = ["What is 12 + 7? The answer is", "ka lo mi ne ru sa ti vo ze po"]
MAX_TOKENS = 8
#: Rounds at most until a commit lands mid-generation: whether the test's pause reaches the
#: engine before its 400 tokens are done is a race (on a quiet machine about one round in two
#: spans; a CI run at load had none in 5).
MAX_ROUNDS = 12
LONG = 400  # tokens of a generation that spans a commit (max-model-len 512)


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
    # booted from version 0's view: the sidecar adopts it (no keyframe), then patches
    assert Board(world.board).latest(RUN).version == BOOT_LATEST  # type: ignore[union-attr]
    seen, commit = threading.Event(), engine.commit_staged

    def held_commit(staged: Any, version: int) -> None:  # until /ready was seen 503
        seen.wait(60)
        commit(staged, version)

    engine.commit_staged = held_commit  # type: ignore[method-assign]
    sc = start_sidecar(
        world.board, RUN, engine, url, config=SidecarConfig(commit_mode="drain", follower=ADOPT)
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
        assert st.adoptions == 1 and st.bytes_fetched == sum(
            r.size for s in plan.steps for r in s.objects
        )
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


def start_long_stream(
    url: str, world: World
) -> tuple[threading.Thread, list[dict[str, Any]], dict[str, Any]]:
    """:func:`_long_stream` in a thread, returned once its first chunk came: the thread, the
    chunks (growing) and the outcome (``status``, ``headers``, ``error``)."""
    chunks: list[dict[str, Any]] = []
    first, out = threading.Event(), dict[str, Any]()
    t = threading.Thread(target=_long_stream, args=(url, world, chunks, first, out))
    t.start()
    assert first.wait(60) and "error" not in out, out.get("error")
    return t, chunks, out


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
        while rounds < 2 or (spanned == 0 and rounds < MAX_ROUNDS):
            rounds += 1
            follower.stop()  # the next version waits until a generation is in flight
            v = world.publish()
            t, chunks, out = start_long_stream(sc.url, world)
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
        assert spanned >= 1, f"no commit landed mid-generation in {rounds} rounds"
        assert sc.sidecar.gate.mode == "pause" and len(sc.sidecar.gate.pauses) >= 2
        assert server.get("/weight_info") == {"weight_version": str(world.latest)}
    finally:
        sc.stop()
    check_labels(server.url, world, labelled)
