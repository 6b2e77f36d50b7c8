"""The sidecar end to end: the real openai client → sidecar → built-in engine, versions moving.

Every response's version label is checked against what the reference model itself produces
for that version (greedy tokens and logprobs, bit for bit), so a mislabelled response fails.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

import httpx
import openai

from rollpatch.engines.reference import ReferenceEngine, ReferenceRuntime
from rollpatch.follower import FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import RunningSidecar, start_sidecar

PROMPT = "12 + 7 ="
MAX_TOKENS = 6
MODEL = "model"  # the reference engine serves its directory name


class World:
    """A board with a run whose versions visibly change the model's greedy output."""

    def __init__(self, root: Path, model: Path) -> None:
        self.model = model
        self.oracle = ReferenceRuntime(self.model, threads=1)
        self.masters = {n: t.to_array().astype(np.float32) for n, t in self.oracle.view.items()}
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(
            self.board,
            "r1",
            PublisherConfig(keyframe_every=4, skip_strides=(2,)),
            asynchronous=False,
        )
        self.expected: dict[int, tuple[list[int], list[float]]] = {}
        self.rng = np.random.default_rng(1)
        self.lock = threading.Lock()
        self.prompt_ids = self.oracle.tokenizer(PROMPT)["input_ids"]
        self.publish()

    def publish(self) -> int:
        """Publish the next version (a visible weight change) and record its greedy output."""
        with self.lock:
            if self.expected:
                for m in self.masters.values():
                    if m.ndim == 2:
                        m += (0.01 * self.rng.standard_normal(m.shape)).astype(np.float32)
            view = cast_view(self.masters, "bf16")
            self.oracle.load_view(view)
            gen = self.oracle.generate(
                self.prompt_ids, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
            )
            steps = list(gen)
            v = self.publisher.publish(self.masters)
            self.publisher.flush()
            self.expected[v] = ([s.token_id for s in steps], [s.logprob for s in steps])
            return v

    def check(self, choice: Any, version: int) -> None:
        tokens, logprobs = self.expected[version]
        assert choice["token_ids"] == tokens, f"tokens are not those of version {version}"
        got = choice["logprobs"]["token_logprobs"]
        assert np.array_equal(np.array(got, dtype=np.float32), np.array(logprobs, np.float32))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> World:
    return World(tmp_path_factory.mktemp("sidecar"), tiny_model)


def _start(
    world: World, mode: str = "drain", token: str | None = None, run: str = "r1"
) -> RunningSidecar:
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    return start_sidecar(
        world.board,
        run,
        engine,
        engine.url,
        config=SidecarConfig(
            commit_mode=mode, admin_token=token, follower=FollowerConfig(poll_s=0.05)
        ),
    )


def _wait_ready(sc: RunningSidecar) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(f"{sc.url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "sidecar never became ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def sidecar(world: World) -> Any:
    sc = _start(world, token="s3cret")
    _wait_ready(sc)
    yield sc
    sc.stop()


def _client(sc: RunningSidecar) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sc.url}/v1", api_key="unused", max_retries=0)


def _complete(client: openai.OpenAI, **rollpatch: Any) -> tuple[dict[str, Any], dict[str, str]]:
    extra: dict[str, Any] = {"return_token_ids": True}
    if rollpatch:
        extra["rollpatch"] = rollpatch
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body=extra,
    )
    return raw.parse().model_dump(), dict(raw.headers)


def test_ready_version_metrics(sidecar: RunningSidecar, world: World) -> None:
    v = httpx.get(f"{sidecar.url}/version").json()
    assert v["served"] == max(world.expected) and v["state"] in ("IDLE", "FETCHING")
    assert "rollpatch_served_version" in httpx.get(f"{sidecar.url}/metrics").text


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
    follower = sidecar.sidecar.follower
    follower.stop()  # hold the replica behind, deterministically
    try:
        v = world.publish()
        with pytest.raises(openai.ConflictError) as e:  # behind, and the caller will not wait
            _complete(client, exact_version=v, wait_s=0)
        assert "not to wait" in e.value.response.json()["reason"]
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


def test_bad_requests(sidecar: RunningSidecar) -> None:
    r = httpx.post(f"{sidecar.url}/v1/completions", content=b"{nope")
    assert r.status_code == 400
    r = httpx.post(
        f"{sidecar.url}/v1/completions", json={"prompt": "x", "rollpatch": {"min_version": "soon"}}
    )
    assert r.status_code == 400 and "min_version" in r.json()["error"]["message"]


def test_hostile_bodies_never_wedge_the_island(sidecar: RunningSidecar, world: World) -> None:
    """Issue 11: NaN/Infinity bodies leaked an admission slot; the next drain commit then
    waited forever and every later request hung. Now: 400/413, and the island keeps serving."""
    url = f"{sidecar.url}/v1/completions"
    json_ct = {"content-type": "application/json"}
    hostile = [
        b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}',
        b'{"prompt": "x", "max_tokens": 1, "temperature": Infinity}',
        b'{"prompt": "x", "max_tokens": 1, "top_p": -Infinity, "stream": true}',
        b'{"prompt": "x", "rollpatch": {"min_version": 1e400}}',
        b'{"prompt": "x", "logit_bias": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"prompt": "\\udc00"}',
    ]
    for _ in range(3):
        for raw in hostile:
            r = httpx.post(url, content=raw, headers=json_ct, timeout=30)
            assert r.status_code == 400, (raw[:60], r.status_code, r.text[:200])
            assert r.json()["error"]["type"] == "invalid_request_error"
    big = httpx.post(
        url, content=b'{"prompt": "' + b"x" * (16 << 20) + b'"}', headers=json_ct, timeout=60
    )
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    assert sidecar.sidecar.gate.inflight == 0
    v = world.publish()  # catching up needs a drain commit: it must not wait on a leaked slot
    body, _ = _complete(_client(sidecar), min_version=v, wait_s=30)
    assert body["rollpatch"]["version_start"] == body["rollpatch"]["version_end"] == v
    world.check(body["choices"][0], v)
    assert httpx.get(f"{sidecar.url}/ready").status_code == 200
    assert sidecar.sidecar.gate.inflight == 0


def test_ready_reflects_a_wedged_gate_and_a_dead_engine(sidecar: RunningSidecar) -> None:
    sc = sidecar.sidecar
    assert httpx.get(f"{sidecar.url}/ready").json()["ready"] is True
    sc.gate._busy_since = 0.0  # a weight change "running" since boot: far past admit_timeout_s
    try:
        r = httpx.get(f"{sidecar.url}/ready")
        assert r.status_code == 503 and "weight commit" in r.json()["error"]["message"]
    finally:
        sc.gate._busy_since = None
    assert httpx.get(f"{sidecar.url}/ready").status_code == 200


def test_ready_is_503_when_the_engine_is_unreachable(world: World) -> None:
    engine = ReferenceEngine.from_dir(world.model, threads=1)
    # the follower commits through the adapter, but generation is served at a dead address
    sc = start_sidecar(
        world.board,
        "r1",
        engine,
        "http://127.0.0.1:9",
        config=SidecarConfig(follower=FollowerConfig(poll_s=0.05), ready_probe_s=1.0),
    )
    try:
        deadline = time.monotonic() + 60
        while sc.sidecar.follower.version is None:
            assert time.monotonic() < deadline, "never loaded a version"
            time.sleep(0.05)
        r = httpx.get(f"{sc.url}/ready")
        assert r.status_code == 503 and "engine unreachable" in r.json()["error"]["message"]
    finally:
        sc.stop()


def test_admin_token(sidecar: RunningSidecar) -> None:
    assert httpx.post(f"{sidecar.url}/admin/sync").status_code == 401
    r = httpx.post(
        f"{sidecar.url}/admin/sync", headers={"Authorization": "Bearer s3cret"}, timeout=60
    )
    assert r.status_code == 200 and isinstance(r.json()["version"], int)


def test_not_ready_is_503(world: World) -> None:
    sc = _start(world, run="nothing-published")
    try:
        r = httpx.post(f"{sc.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert httpx.get(f"{sc.url}/ready").status_code == 503
    finally:
        sc.stop()


def test_concurrent_load_while_versions_advance(sidecar: RunningSidecar, world: World) -> None:
    client = _client(sidecar)
    errors: list[BaseException] = []
    seen: set[int] = set()
    done = threading.Event()

    def worker() -> None:
        try:
            count = 0
            while not done.is_set() or count < 4:
                count += 1
                body, _ = _complete(client, max_lag=1, wait_s=30)
                v = body["rollpatch"]["version_start"]
                assert body["rollpatch"]["version_end"] == v
                world.check(body["choices"][0], v)
                seen.add(v)
        except BaseException as e:  # noqa: BLE001 - collected and re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for _ in range(3):
        world.publish()
        time.sleep(0.2)
    done.set()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert len(seen) >= 2, "versions should have advanced under load"


def test_pause_mode_reports_spanning_versions(world: World) -> None:
    sc = _start(world, mode="pause")
    try:
        _wait_ready(sc)
        client = _client(sc)
        _complete(client, min_version=max(world.expected), wait_s=60)
        spans = []
        for _ in range(5):
            out: dict[str, Any] = {}

            def long_request(out: dict[str, Any] = out) -> None:
                raw = client.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=400,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                out["rp"] = raw.model_dump()["rollpatch"]

            t = threading.Thread(target=long_request)
            t.start()
            time.sleep(0.1)
            world.publish()
            t.join(120)
            spans.append((out["rp"]["version_start"], out["rp"]["version_end"]))
            if spans[-1][0] != spans[-1][1]:
                break
        assert all(s <= e for s, e in spans)
        assert any(s < e for s, e in spans), f"no commit landed mid-generation: {spans}"
    finally:
        sc.stop()
