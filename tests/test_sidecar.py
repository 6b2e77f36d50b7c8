"""The sidecar end to end: the real openai client → sidecar → built-in engine, versions moving.

Every response's version label is checked against what the reference model itself produces
for that version (greedy tokens and logprobs, bit for bit), so a mislabelled response fails.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

import httpx
import openai

from rollpatch.sidecar.server import RunningSidecar
from tests.sidecarfix import (
    MODEL,
    PROMPT,
    World,
    _client,
    _complete,
    sidecar,
    world,
)

_FIXTURES = (world, sidecar)  # used by name


def test_ready_version_metrics(sidecar: RunningSidecar, world: World) -> None:
    v = httpx.get(f"{sidecar.url}/version").json()
    assert v["served"] == max(world.expected) and v["state"] in ("IDLE", "FETCHING")
    assert v["kv_across_commit"] == "keep"  # the reference engine keeps generations' caches
    assert "rollpatch_served_version" in httpx.get(f"{sidecar.url}/metrics").text


def test_an_unknown_route_or_method_names_the_routes_served(sidecar: RunningSidecar) -> None:
    """An OpenAI route the sidecar does not proxy (embeddings), or GET on a POST route, gets an
    OpenAI-style error naming what it serves, not Starlette's {"detail": "Not Found"}."""
    r = httpx.post(f"{sidecar.url}/v1/embeddings", json={"input": "x", "model": MODEL})
    err = r.json()["error"]
    assert r.status_code == 404 and err["type"] == "not_found_error"
    assert "no route POST /v1/embeddings" in err["message"]
    assert "POST /v1/completions" in err["message"] and "GET /version" in err["message"]
    assert r.headers.get("x-should-retry") == "false"  # the openai client must not retry it
    r = httpx.get(f"{sidecar.url}/v1/chat/completions")
    assert r.status_code == 405 and "does not take GET" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="no route POST /v1/embeddings"):
        openai.OpenAI(base_url=f"{sidecar.url}/v1", api_key="x", max_retries=0).embeddings.create(
            input="x", model=MODEL
        )


def _connections_opened(sc: RunningSidecar) -> float:
    text = httpx.get(f"{sc.url}/metrics").text
    return float(text.split("\nrollpatch_engine_connections_opened_total ", 1)[1].split()[0])


def test_engine_connections_are_reused(sidecar: RunningSidecar) -> None:
    """Proxied requests, one after another and 4 at once, reuse keep-alive connections to the
    engine: the sidecar's rollpatch_engine_connections_opened_total grows by at most the peak
    concurrency, not with the requests."""
    before = _connections_opened(sidecar)
    client = _client(sidecar)
    for _ in range(12):
        assert _complete(client)[0]["rollpatch"]["version_start"] is not None
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda _: _complete(client)[0], range(4)))
            assert all(b["rollpatch"]["version_start"] is not None for b in got)
    assert _connections_opened(sidecar) - before <= 4


def test_label_matches_weights(sidecar: RunningSidecar, world: World) -> None:
    body, headers = _complete(_client(sidecar))
    rp = body["rollpatch"]
    assert rp["version_start"] == rp["version_end"] == int(headers["x-rollpatch-version-start"])
    assert headers["x-rollpatch-version-end"] == headers["x-rollpatch-version-start"]
    world.check(body["choices"][0], rp["version_start"])


def test_catch_up_then_proxy(sidecar: RunningSidecar, world: World) -> None:
    client = _client(sidecar)
    for _ in range(3):
        v = world.publish()
    body, _ = _complete(client, min_version=v, wait_s=30)
    assert body["rollpatch"]["version_start"] >= v
    world.check(body["choices"][0], body["rollpatch"]["version_start"])


def test_conflicts(sidecar: RunningSidecar, world: World) -> None:
    client = _client(sidecar)
    latest = max(world.expected)
    _complete(client, min_version=latest, wait_s=30)
    with pytest.raises(openai.ConflictError) as e:
        _complete(client, min_version=latest + 5)
    body = e.value.response.json()
    assert (
        body["served"] == latest and body["latest"] == latest and "not published" in body["reason"]
    )
    assert e.value.response.headers["retry-after"]
    with pytest.raises(openai.ConflictError) as e:
        _complete(client, exact_version=0)
    assert "older" in e.value.response.json()["reason"]
    # no retry can change that (versions only move forward): the openai client is told not to
    assert e.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in e.value.response.headers
    follower = sidecar.sidecar.follower
    follower.stop()  # hold the replica behind, deterministically
    try:
        v = world.publish()
        with pytest.raises(openai.ConflictError) as e:  # behind, and the caller will not wait
            _complete(client, exact_version=v, wait_s=0)
        reason = e.value.response.json()["reason"]
        assert (
            "not to wait" in reason and f"behind: serving {v - 1}, the request needs {v}" in reason
        )
        assert "catching up" not in reason  # nothing was started for it
    finally:
        follower.start()
    body, _ = _complete(client, exact_version=v, wait_s=30)
    assert body["rollpatch"]["version_end"] == v


def test_max_lag_header(sidecar: RunningSidecar, world: World) -> None:
    latest = max(world.expected)
    r = httpx.post(
        f"{sidecar.url}/v1/completions",
        headers={"X-Rollpatch-Max-Lag": "0", "X-Rollpatch-Wait-S": "30"},
        json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200 and int(r.headers["x-rollpatch-version-start"]) >= latest


def test_streaming_carries_versions(sidecar: RunningSidecar, world: World) -> None:
    client = _client(sidecar)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chunks = [c.model_dump() for c in stream]
    assert "rollpatch" in chunks[-1] and chunks[-1]["rollpatch"]["version_start"] is not None


def test_a_client_leaving_mid_stream_gives_its_slot_back(sidecar: RunningSidecar) -> None:
    """The stream's slot comes back when the client goes away before the end (the sidecar
    closes its engine connection then), and the island keeps serving."""
    gate = sidecar.sidecar.gate
    # long enough (forced tokens) that the client leaves while the engine still generates
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{sidecar.url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        # one iterator, kept: dropping an unfinished iter_lines() (a temporary, or a `break`
        # out of a for) closes httpx's stream, and with it the connection mid-body, so the
        # client would already have gone when the slot is checked (seen: ~1 run in 5)
        lines = r.iter_lines()
        events: list[str] = []
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data:"):
                events.append(line)
        # mid-stream: token events (no error, not the end), and the stream holds its slot
        assert all(e[5:].strip() != "[DONE]" and "choices" in json.loads(e[5:]) for e in events)
        assert gate.inflight == 1, f"the slot was given back mid-stream, after {events}"
    deadline = time.monotonic() + 30
    while gate.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate.inflight == 0
    chunks = list(
        _client(sidecar).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True)
    )
    assert chunks and chunks[-1].model_dump()["rollpatch"]["version_start"] is not None


def test_a_request_without_max_lag_reads_no_latest(sidecar: RunningSidecar) -> None:
    """LATEST cannot change such a request's answer, so a stale cache costs it no board read
    (a worker-thread hop on its way to the engine); max_lag does read it."""
    sc = sidecar.sidecar
    reads: list[bool] = []
    read = sc.latest

    def counted(refresh: bool = False) -> int | None:
        reads.append(refresh)
        return read(refresh)

    sc.latest = counted  # type: ignore[method-assign]
    try:
        client = _client(sidecar)
        for _ in range(3):
            time.sleep(sc.config.latest_ttl_s + 0.05)  # the cached LATEST is stale now
            body, _ = _complete(client)
            assert body["rollpatch"]["version_start"] is not None
        assert reads == []
        time.sleep(sc.config.latest_ttl_s + 0.05)
        _complete(client, max_lag=5)
        assert reads
    finally:
        del sc.latest
