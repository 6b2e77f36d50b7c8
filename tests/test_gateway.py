"""The gateway end to end: the real openai client → gateway → sidecars → built-in engines.

Three islands follow one board; one is held behind by stopping its follower. Every version
label is checked against what the reference model itself produces for that version, so a
request routed to the wrong island (or mislabelled) fails. The routing tested pure, and a
hostile island: test_gateway_routing.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.gateway import (
    GatewayConfig,
)

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

import httpx
import openai

from rollpatch.engines.reference import ReferenceEngine, ReferenceRuntime
from rollpatch.follower import FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.gateway.server import RunningGateway, start_gateway
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import RunningSidecar, start_sidecar
from tests.conftest import dead_url, until

PROMPT = "12 + 7 ="
MAX_TOKENS = 6
MODEL = "model"
FAST = GatewayConfig(poll_s=0.05, retry_backoff_s=0.05)


class World:
    """A board whose versions visibly change the tiny model's greedy output."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root = root
        self.model = model
        self.oracle = ReferenceRuntime(self.model, threads=1)
        self.masters = {n: t.to_array().astype(np.float32) for n, t in self.oracle.view.items()}
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(
            self.board, "r1", PublisherConfig(keyframe_every=4), asynchronous=False
        )
        self.expected: dict[int, list[int]] = {}
        self.rng = np.random.default_rng(1)
        self.prompt_ids = self.oracle.tokenizer(PROMPT)["input_ids"]
        self.publish()

    def publish(self) -> int:
        """Publish the next version and record its greedy tokens."""
        if self.expected:
            for m in self.masters.values():  # sparse but visible: fast to publish
                if m.ndim == 2:
                    mask = self.rng.random(m.shape) < 0.03
                    noise = 0.05 * self.rng.standard_normal(int(mask.sum()))
                    m[mask] += noise.astype(np.float32)
        self.oracle.load_view(cast_view(self.masters, "bf16"))
        steps = list(self.oracle.generate(self.prompt_ids, max_tokens=MAX_TOKENS, temperature=0))
        v = self.publisher.publish(self.masters)
        self.publisher.flush()
        self.expected[v] = [s.token_id for s in steps]
        return v

    def sidecar(self) -> RunningSidecar:
        engine = ReferenceEngine.from_dir(self.model, threads=1)
        return start_sidecar(
            self.board,
            "r1",
            engine,
            engine.url,
            config=SidecarConfig(follower=FollowerConfig(poll_s=0.05)),
        )


def _served(gw: RunningGateway) -> dict[str, int | None]:
    return {i["name"]: i["served"] for i in httpx.get(f"{gw.url}/islands").json()["islands"]}


def _sample(gw: RunningGateway, name: str, **labels: str) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> World:
    return World(tmp_path_factory.mktemp("gateway"), tiny_model)


@pytest.fixture(scope="module")
def islands(world: World) -> Iterator[dict[str, RunningSidecar]]:
    running = {name: world.sidecar() for name in ("a", "b", "c")}
    yield running
    for sc in running.values():
        sc.stop()


@pytest.fixture(scope="module")
def gateway(islands: dict[str, RunningSidecar], world: World) -> Iterator[RunningGateway]:
    gw = start_gateway([f"{n}={sc.url}" for n, sc in islands.items()], config=FAST)
    latest = max(world.expected)
    until(lambda: set(_served(gw).values()) == {latest}, "every island to load")
    yield gw
    gw.stop()


def _client(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


def _complete(client: openai.OpenAI, **rollpatch: Any) -> tuple[dict[str, Any], dict[str, str]]:
    extra: dict[str, Any] = {"return_token_ids": True}
    if rollpatch:
        extra["rollpatch"] = rollpatch
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
    )
    return raw.parse().model_dump(), dict(raw.headers)


def _check(world: World, body: dict[str, Any]) -> int:
    """The response's label is the version whose weights produced it; returns it."""
    rp = body["rollpatch"]
    assert rp["version_start"] == rp["version_end"]
    assert body["choices"][0]["token_ids"] == world.expected[rp["version_start"]]
    return int(rp["version_start"])


# ---- end to end -----------------------------------------------------------------------------


def test_openai_client_and_island_report(gateway: RunningGateway, world: World) -> None:
    client = _client(gateway)
    seen = set()
    for _ in range(3):
        body, headers = _complete(client)
        island = headers["x-rollpatch-island"]
        assert body["rollpatch"]["island"] == island and island in ("a", "b", "c")
        assert int(headers["x-rollpatch-version-start"]) == _check(world, body)
        seen.add(island)
    assert len(seen) == 3, f"idle islands should share the load round-robin: {seen}"
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{gateway.url}/health").json()
    assert health["reachable"] == health["serving"] == 3
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'rollpatch_gateway_requests_total{island="a",outcome="ok"}' in text
    assert 'rollpatch_gateway_island_served_version{island="b"}' in text


def test_routes_by_served_version(
    gateway: RunningGateway, islands: dict[str, RunningSidecar], world: World
) -> None:
    client = _client(gateway)
    old = world.publish()  # so that an older version (old - 1) exists too
    until(lambda: set(_served(gateway).values()) == {old}, "every island to move")
    follower = islands["b"].sidecar.follower
    follower.stop()  # hold island b on the old version
    try:
        new = world.publish()
        until(lambda: _served(gateway) == {"a": new, "b": old, "c": new}, "a and c to move")
        info = {i["name"]: i for i in httpx.get(f"{gateway.url}/islands").json()["islands"]}
        assert info["b"]["lag"] == 1 and info["b"]["reachable"] and info["a"]["lag"] == 0
        retries = _sample(gateway, "rollpatch_gateway_retries_total")
        for _ in range(4):  # wait_s=0: a misrouted request would be refused and retried
            body, headers = _complete(client, min_version=new, wait_s=0)
            assert headers["x-rollpatch-island"] in ("a", "c") and _check(world, body) == new
        body, headers = _complete(client, exact_version=old, wait_s=0)
        assert headers["x-rollpatch-island"] == "b" and _check(world, body) == old
        assert _sample(gateway, "rollpatch_gateway_retries_total") == retries
        # nobody serves an older exact version: one sidecar's own 409 comes back
        with pytest.raises(openai.ConflictError) as e:
            _complete(client, exact_version=old - 1)
        refusal = e.value.response
        assert "older" in refusal.json()["reason"] and refusal.json()["latest"] == new
        assert refusal.headers["x-should-retry"] == "false"  # final: versions move forward
        assert "retry-after" not in refusal.headers and refusal.headers["x-rollpatch-island"]
        assert _sample(gateway, "rollpatch_gateway_conflicts_total") >= 1
    finally:
        follower.start()
    until(lambda: _served(gateway)["b"] == new, "b to catch up")


def test_streaming_through_gateway(gateway: RunningGateway, world: World) -> None:
    stream = _client(gateway).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"rollpatch": {"max_lag": 0}},
    )
    chunks = [c.model_dump() for c in stream]
    last = chunks[-1]["rollpatch"]
    assert last["island"] in ("a", "b", "c") and last["version_start"] == max(world.expected)
    assert all("rollpatch" not in c for c in chunks[:-1])
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3, "stream": True},
    ) as r:
        lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and r.headers["x-rollpatch-island"] in ("a", "b", "c")
        assert r.headers["x-rollpatch-version-start"]
    assert lines[-1] == "data: [DONE]" and '"island"' in lines[-2]


def test_bad_requests(gateway: RunningGateway) -> None:
    before = _sample(gateway, "rollpatch_gateway_responses_total", code="400")
    r = httpx.post(f"{gateway.url}/v1/completions", content=b"{nope")
    assert r.status_code == 400
    r = httpx.post(
        f"{gateway.url}/v1/completions", json={"prompt": "x", "rollpatch": {"min_version": "soon"}}
    )
    assert r.status_code == 400 and "min_version" in r.json()["error"]["message"]
    # refused by the gateway itself: counted among its responses all the same
    assert _sample(gateway, "rollpatch_gateway_responses_total", code="400") == before + 2


def test_an_unknown_route_names_the_routes_served(gateway: RunningGateway) -> None:
    r = httpx.post(f"{gateway.url}/v1/embeddings", json={"input": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    msg = r.json()["error"]["message"]
    assert "no route POST /v1/embeddings: the gateway serves" in msg
    assert "POST /v1/completions" in msg


def test_hostile_bodies_are_refused_and_islands_keep_serving(
    gateway: RunningGateway, islands: dict[str, RunningSidecar], world: World
) -> None:
    """Issue 11: 4 NaN bodies through the gateway froze both islands. Now each is a 400 (a
    413 when too large) from the gateway, and every island still serves."""
    url = f"{gateway.url}/v1/completions"
    json_ct = {"content-type": "application/json"}
    for raw in [b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}'] * 4 + [
        b'{"prompt": "x", "max_tokens": 1, "temperature": Infinity}',
        b'{"prompt": "x", "n": 1e400}',
        b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}",
    ]:
        r = httpx.post(url, content=raw, headers=json_ct, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        url, content=b'{"prompt": "' + b"x" * (16 << 20) + b'"}', headers=json_ct, timeout=60
    )
    assert r.status_code == 413
    assert all(i.sidecar.gate.inflight == 0 for i in islands.values())
    body, _ = _complete(_client(gateway), max_lag=0, wait_s=30)
    _check(world, body)


def test_island_down_retried_then_all_down(
    islands: dict[str, RunningSidecar], world: World
) -> None:
    doomed = world.sidecar()
    until(lambda: doomed.sidecar.follower.version == max(world.expected), "the island to load")
    # slow polls: the gateway still believes the island is up when it dies
    gw = start_gateway(
        [f"doomed={doomed.url}", f"a={islands['a'].url}"], config=GatewayConfig(poll_s=30)
    )
    try:
        doomed.stop()
        body, headers = _complete(_client(gw))
        assert headers["x-rollpatch-island"] == "a" and body["rollpatch"]["island"] == "a"
        _check(world, body)
        assert _sample(gw, "rollpatch_gateway_retries_total") == 1
        assert (
            _sample(gw, "rollpatch_gateway_requests_total", island="doomed", outcome="unreachable")
            == 1
        )
        info = httpx.get(f"{gw.url}/islands").json()["islands"]
        assert info[0]["name"] == "doomed" and info[0]["reachable"] is False
    finally:
        gw.stop()
    gw = start_gateway([f"doomed={doomed.url}", dead_url()], config=FAST)
    try:
        r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "no island could be reached" in r.json()["error"]["message"]
        assert _sample(gw, "rollpatch_gateway_retries_total") == 1
    finally:
        gw.stop()


def test_loading_island_is_skipped(islands: dict[str, RunningSidecar], world: World) -> None:
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    loading = start_sidecar(world.board, "nothing-published", engine, engine.url)
    gw = start_gateway([f"loading={loading.url}", f"c={islands['c'].url}"], config=FAST)
    try:
        for _ in range(2):
            _, headers = _complete(_client(gw))
            assert headers["x-rollpatch-island"] == "c"
        assert _sample(gw, "rollpatch_gateway_retries_total") == 0
    finally:
        gw.stop()
        loading.stop()


def test_concurrent_requests_spread(gateway: RunningGateway, world: World) -> None:
    client = _client(gateway)
    used: list[str] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(3):
                body, headers = _complete(client, max_lag=0, wait_s=30)
                _check(world, body)
                used.append(headers["x-rollpatch-island"])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert set(used) == {"a", "b", "c"} and len(used) == 18


def _wedging_island(
    served: int | None, frozen: threading.Event, release: threading.Event, post: Any
) -> tuple[Any, str]:
    """A fake island that answers ``/version`` (serving ``served``) until ``frozen``, then
    holds every request until ``release``; ``post(handler)`` answers a POST. Returns the
    server (``shutdown()`` it) and its URL."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Island(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if frozen.is_set():
                release.wait(60)
                return
            body = json.dumps(
                {"run": "r1", "served": served, "latest": served, "state": "IDLE", "lag": 0}
            ).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            post(self)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Island)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_an_island_that_stops_answering_is_given_up_and_the_request_sent_elsewhere(
    islands: dict[str, RunningSidecar], world: World
) -> None:
    """An island that accepts connections and never answers (a stopped process): a request
    already sent there is given up once its ``/version`` poll fails, and another island
    answers it; nothing waits for as long as the caller would."""
    frozen, release = threading.Event(), threading.Event()

    def post(_: Any) -> None:  # the request reached it, then it froze
        frozen.set()
        release.wait(60)

    srv, url = _wedging_island(islands["a"].sidecar.follower.version, frozen, release, post)
    gw = start_gateway(
        [f"frozen={url}", f"a={islands['a'].url}"],
        config=GatewayConfig(poll_s=0.1, poll_timeout_s=0.5, retry_backoff_s=0.05),
    )
    try:
        t0 = time.monotonic()
        got = []
        for _ in range(4):  # rotation: some go to the frozen island first
            r = httpx.post(
                f"{gw.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30
            )
            got.append((r.status_code, r.headers.get("x-rollpatch-island")))
        assert got == [(200, "a")] * 4, got
        assert frozen.is_set() and time.monotonic() - t0 < 15
        assert (
            _sample(gw, "rollpatch_gateway_requests_total", island="frozen", outcome="unreachable")
            >= 1
        )
    finally:
        release.set()
        gw.stop()
        srv.shutdown()


def test_a_stream_whose_island_stops_answering_ends_with_an_error(
    islands: dict[str, RunningSidecar],
) -> None:
    """A stream from an island that stops answering mid-way (a wedged process): once the
    island's poll fails, the stream ends with the gateway's mid-stream error event instead
    of stalling for as long as the caller waits."""
    import json

    frozen, release = threading.Event(), threading.Event()
    served = islands["a"].sidecar.follower.version

    def post(h: Any) -> None:  # two chunks, then it wedges, and its polls with it
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.send_header("X-Rollpatch-Version-Start", str(served))
        h.end_headers()
        for _ in range(2):
            h.wfile.write(b"data: " + json.dumps({"choices": [{"text": "a"}]}).encode() + b"\n\n")
            h.wfile.flush()
        frozen.set()
        release.wait(60)

    srv, url = _wedging_island(served, frozen, release, post)
    gw = start_gateway(
        [f"wedged={url}"],
        config=GatewayConfig(poll_s=0.1, poll_timeout_s=0.5, retry_backoff_s=0.05),
    )
    try:
        t0 = time.monotonic()
        body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=30) as r:
            data = [line for line in r.iter_lines() if line.startswith("data:")]
        assert time.monotonic() - t0 < 15
        assert len(data) == 3 and "failed mid-stream" in data[-1], data
        assert "stopped answering mid-stream" in data[-1]
    finally:
        release.set()
        gw.stop()
        srv.shutdown()


def test_shutdown_drains_streams_in_flight_and_refuses_new_requests(
    islands: dict[str, RunningSidecar],
) -> None:
    """What `rollpatch gateway` does on SIGTERM (--shutdown-grace): new requests get 503 (a
    client or load balancer goes to another gateway), a stream in flight runs to its end."""
    gw = start_gateway([f"a={islands['a'].url}"], config=FAST)
    try:
        body = {"prompt": PROMPT, "max_tokens": 64, "stream": True, "ignore_eos": True}
        done: list[bool] = []
        with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:")).startswith("data: {")
            drainer = threading.Thread(target=lambda: done.append(gw.gateway.drain(30.0)))
            drainer.start()
            until(lambda: gw.gateway.draining, "draining")
            refused = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503 and "gateway is shutting down" in refused.text
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and len(rest) > 2
        drainer.join(30)
        assert done == [True]
    finally:
        gw.stop()
