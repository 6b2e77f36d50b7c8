"""A real SGLang behind the sidecar: elastic join, both commit modes, labels SGLang confirms.

One SGLang server for the module (the venv from ``scripts/sglang-env``), booted from version
0's view of a run whose LATEST is already 5: the sidecar is not ready until the follower has
patched SGLang up to LATEST (the join plan is five steps, decoded against ``words()`` and
staged inside SGLang), then serves while versions keep coming, in drain mode and in pause mode
(SGLang's ``/pause_generation`` ``retract`` … ``/continue_generation``). Every response carries
the sidecar's label in body and headers, and SGLang's own per-response ``weight_version`` (and
per-token ``weight_versions`` spans) must say the same; every single-version answer is then
checked against what SGLang answers when set to that version. Skipped, loudly, without the
SGLang venv.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from rollpatch.board import Board
from rollpatch.follower import FollowerConfig
from tests import live_servers, vllm_env
from tests.conftest import until
from tests.sglang_env import sglang_python, venv_dir
from tests.sidecarworld import World, ready_then_hold_loads, until_back_on

RUN = "rl"
FAST = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=60.0)
ADOPT = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=60.0, boot="adopt")
PROMPTS = ["What is 12 + 7? The answer is", "ka lo mi ne ru sa ti vo ze po"]
MAX_TOKENS = 8
#: Rounds at most until a commit lands mid-generation: whether the test's pause reaches the
#: engine before its 400 tokens are done is a race (on a quiet machine about one round in two
#: spans; a CI run at load had none in 5), bounded by the versions left to publish.
MAX_ROUNDS = 12
#: When a round commits, as fractions of the shortest long generation seen so far (one alone
#: first, then each round's): a fixed sleep (0.5 s + 0.5 s a round) missed every round on a
#: quiet machine, where the 400 tokens took under a second (10 rounds of 10, 2026-12-04), and
#: only hit under load; the first generation alone took 19 s in a loaded CI run, so one
#: measurement is not enough.
COMMIT_AT = (0.3, 0.2, 0.45, 0.6)
LONG = 400
BOOT_LATEST = 5
N_VERSIONS = 16


@pytest.fixture(scope="module")
def server(live_sglang: live_servers.SharedServer) -> Iterator[vllm_env.Server]:
    """The session's SGLang server (tests.live_servers), holding the live tiny model's view;
    not one function of its sgl_kernel import shim may have run."""
    if sglang_python() is None:
        pytest.skip(
            f"SKIPPED LIVE SGLANG SIDECAR TESTS: no SGLang venv at {venv_dir()}: "
            "build it with `scripts/sglang-env` (≈2 min, ≈2.8 GB; cached)"
        )
    pytest.importorskip("transformers")
    pytest.importorskip("openai")
    srv = live_sglang.acquire()
    yield srv
    live_sglang.release()


@pytest.fixture(scope="module")
def world(
    server: vllm_env.Server,
    live_sglang: live_servers.SharedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> World:
    return World(
        tmp_path_factory.mktemp("sglang-sidecar"), live_sglang.model, seed=23, versions=N_VERSIONS
    )


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(
    client: Any, world: World, prompt: int, max_tokens: int = MAX_TOKENS, **rollpatch: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    extra: dict[str, Any] = {"ignore_eos": True}
    if rollpatch:
        extra["rollpatch"] = rollpatch
    raw = client.completions.with_raw_response.create(
        model=str(world.model),
        prompt=PROMPTS[prompt],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        extra_body=extra,
    )
    return raw.http_response.json(), {k.lower(): v for k, v in raw.headers.items()}


class Labelled:
    """Responses through the sidecar, by the version that labels them; every label must be
    the one SGLang reports itself (``metadata.weight_version``, and its spans)."""

    def __init__(self) -> None:
        self.by_version: dict[int, list[tuple[int, dict[str, Any]]]] = {}
        self.spans: list[tuple[int, int]] = []

    def add(self, prompt: int, body: dict[str, Any], headers: Mapping[str, str]) -> None:
        rp = body["rollpatch"]
        start, end = rp["version_start"], rp["version_end"]
        assert isinstance(start, int) and isinstance(end, int) and start <= end
        assert headers["x-rollpatch-version-start"] == str(start)
        assert headers["x-rollpatch-version-end"] == str(end)
        meta = body["metadata"]
        assert meta["weight_version"] == str(end), (rp, meta)  # SGLang agrees
        spans = [
            s["version"] if isinstance(s, dict) else s[0] for s in meta.get("weight_versions") or []
        ]
        if spans:
            assert spans[0] == str(start) and spans[-1] == str(end), (rp, meta)
        self.spans.append((start, end))
        if start == end:
            self.by_version.setdefault(start, []).append((prompt, body))


def _answer(body: Mapping[str, Any]) -> Any:
    c = body["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def check_labels(url: str, world: World, labelled: Labelled) -> None:
    """Set SGLang to each labelled version (a keyframe, in place) and ask it directly."""
    from rollpatch.engines.sglang import SglangEngine

    engine, client = SglangEngine(url), _client(url)
    answers: dict[int, list[Any]] = {}
    wanted = {w for v in labelled.by_version for w in (v - 1, v, v + 1) if 0 <= w <= world.latest}
    try:
        for v in sorted(wanted):
            engine.load(world.views[v], v)
            answers[v] = [_answer(_complete(client, world, p)[0]) for p in range(len(PROMPTS))]
    finally:
        engine.close()
    for v, seen in labelled.by_version.items():
        for prompt, body in seen:
            assert _answer(body) == answers[v][prompt], (
                f"a response labelled {v} is not what version {v} answers"
            )
        for w in (v - 1, v + 1):
            if w in answers:
                assert answers[w] != answers[v], f"versions {v} and {w} answer alike"


def test_elastic_join_then_drain_mode(server: vllm_env.Server, world: World) -> None:
    import httpx

    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import make_engine, start_sidecar

    engine, url = make_engine("sglang", engine_url=server.url)
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
        v = httpx.get(f"{sc.url}/version").json()
        assert v["served"] == BOOT_LATEST and v["kv_across_commit"] == "recompute"  # retract
        plan = sc.sidecar.follower.last_plan
        assert plan is not None and plan.have == 0 and len(plan.steps) == BOOT_LATEST
        assert not any(s.is_keyframe for s in plan.steps)  # through patches, no keyframe
        st = sc.sidecar.follower.status()
        assert st.adoptions == 1 and st.bytes_fetched == sum(
            r.size for s in plan.steps for r in s.objects
        )
        assert engine.digest == world.views[BOOT_LATEST].digest()
        assert engine.weight_version() == str(BOOT_LATEST)  # type: ignore[attr-defined]

        client, labelled = _client(sc.url), Labelled()
        for p in range(len(PROMPTS)):
            labelled.add(p, *_complete(client, world, p))
        for _ in range(2):
            v = world.publish()  # one step: decoded and staged inside SGLang
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
        held = engine.held(fresh=True)  # type: ignore[attr-defined]
        assert held[1] == world.views[world.latest].digest()
    finally:
        sc.stop()
    check_labels(server.url, world, labelled)


def _long(url: str, world: World, out: dict[str, Any]) -> None:
    import httpx

    body = {
        "model": str(world.model),
        "prompt": PROMPTS[1],
        "max_tokens": LONG,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
    }
    try:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
        out["status"], out["headers"], out["body"] = r.status_code, dict(r.headers), r.json()
        out["took"] = time.perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - re-raised by the test
        out["error"] = e


def test_pause_mode_spans_commits(server: vllm_env.Server, world: World) -> None:
    """Pause mode: a generation in flight is retracted by SGLang's pause, recomputed after
    the commit with the new weights, and labelled with both versions — as SGLang's own
    per-token spans say. Commits here are double-buffered (``--writes double_buffer``:
    storage exchanged under the pause)."""
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import make_engine, start_sidecar

    engine, url = make_engine("sglang", engine_url=server.url, writes="double_buffer")
    have = world.latest
    engine.load(world.views[have], have)  # the label checks left the server elsewhere
    sc = start_sidecar(
        world.board, RUN, engine, url, config=SidecarConfig(commit_mode="pause", follower=FAST)
    )
    labelled = Labelled()
    try:
        client, follower = _client(sc.url), sc.sidecar.follower
        labelled.add(0, *_complete(client, world, 0, min_version=have, wait_s=60))
        alone: dict[str, Any] = {}
        _long(sc.url, world, alone)  # how long 400 tokens take here, with no commit
        assert alone.get("status") == 200, alone
        gen_s = alone["took"]  # the shortest generation seen: a first one may be far slower
        spanned = rounds = 0
        while rounds < 2 or (spanned == 0 and rounds < MAX_ROUNDS):
            assert world.latest + 1 < len(world.masters), (
                f"no commit landed mid-generation in {rounds} rounds ({gen_s:.2f} s each)"
            )
            rounds += 1
            follower.stop()  # the next version waits until a generation is in flight
            v = world.publish()
            out: dict[str, Any] = {}
            t = threading.Thread(target=_long, args=(sc.url, world, out))
            t.start()
            # admitted before the commit is timed (on a loaded host the request's thread may
            # start late: then it was admitted after the commit, and labelled v alone)
            deadline = time.monotonic() + 60
            while sc.sidecar.gate.inflight == 0:  # on failure: the island's reason, the request's
                why = (sc.sidecar.not_ready_reason(), follower.status().last_error, out)
                assert time.monotonic() < deadline, f"the long generation never admitted: {why}"
                time.sleep(0.02)
            time.sleep(gen_s * COMMIT_AT[(rounds - 1) % len(COMMIT_AT)])
            assert follower.sync() == v  # staged while generating, scattered under the pause
            follower.start()
            t.join(180)
            assert out.get("status") == 200 and "error" not in out, out
            gen_s = min(gen_s, out["took"])
            body = out["body"]
            c = body["choices"][0]
            assert len(c["logprobs"]["tokens"]) == LONG, (  # kept, not aborted
                len(c["text"]),
                c["finish_reason"],
                body.get("usage"),
                body.get("metadata"),
                {k: str(x)[:200] for k, x in c["logprobs"].items()},
            )
            labelled.add(1, body, out["headers"])
            label = body["rollpatch"]
            assert label in (
                {"version_start": v - 1, "version_end": v},
                {"version_start": v - 1, "version_end": v - 1},
            ), label
            spanned += label["version_end"] == v
            labelled.add(0, *_complete(client, world, 0))
            assert labelled.spans[-1] == (v, v)
        assert spanned >= 1, f"no commit landed mid-generation in {rounds} rounds"
        assert engine.weight_version() == str(world.latest)  # type: ignore[attr-defined]
    finally:
        sc.stop()
    labelled.by_version = {
        v: [(p, b) for p, b in seen if p == 0] for v, seen in labelled.by_version.items()
    }
    check_labels(server.url, world, labelled)


def test_an_sglang_restarted_under_the_sidecar_is_taken_out_and_re_synced(
    server: vllm_env.Server, world: World
) -> None:
    """An SGLang restarted under a running sidecar boots its checkpoint, with no control
    thread and no rollpatch state: before, the audit's failed calls were only logged and
    the sidecar went on labelling answers with the version it had committed. Now a failed
    control call starts the control threads again, the loaders' new identities take the
    island out of rotation at that audit, and the follower re-syncs it from a keyframe. (The
    restart here: the loader's state dropped by fault injection, as a restart leaves it.)"""
    import httpx

    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import make_engine, start_sidecar

    engine, url = make_engine("sglang", engine_url=server.url)
    have = world.latest
    engine.load(world.views[have], have)
    cfg = FollowerConfig(
        poll_s=0.05, backoff_s=0.01, timeout_s=120.0, audit_bytes_per_s=2**20, audit_period_s=0.05
    )
    sc = start_sidecar(world.board, RUN, engine, url, config=SidecarConfig(follower=cfg))
    try:
        deadline = time.monotonic() + 120
        seen, loaded = ready_then_hold_loads(sc.url, engine, deadline, hold_s=60)
        with engine._lock:  # not between an audit's calls
            (out,) = engine.channel.commands([{"op": "forget"}], flush=False)
        assert out.get("ok") and out.get("forgot"), out
        while httpx.get(f"{sc.url}/ready").status_code != 503:
            assert time.monotonic() < deadline + 60, "the restart was never noticed"
            time.sleep(0.02)
        seen.set()
        until_back_on(sc, have, deadline + 180)
        assert loaded == [have] and sc.sidecar.follower.status().audits == 1
        assert engine.held(fresh=True)[1] == world.views[have].digest()
    finally:
        sc.stop()


def _driven(server: vllm_env.Server, world: World) -> tuple[Any, Any]:
    """A sidecar driving the session's SGLang on the newest version, its audit fast."""
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import make_engine, start_sidecar

    engine, url = make_engine("sglang", engine_url=server.url)
    engine.load(world.views[world.latest], world.latest)
    cfg = FollowerConfig(
        poll_s=0.05, backoff_s=0.01, timeout_s=120.0, audit_bytes_per_s=2**22, audit_period_s=0.05
    )
    return engine, start_sidecar(world.board, RUN, engine, url, config=SidecarConfig(follower=cfg))


def test_weights_written_behind_the_sidecar_take_it_out_and_are_re_synced(
    server: vllm_env.Server, world: World
) -> None:
    """Another writer of SGLang's weights (its own /update_weights_from_disk): before session
    38 the audit logged the mismatch every period while the sidecar went on serving and
    labelling the other weights with its version (an audit's HIGH finding). Now the audit's
    mismatch makes the adapter hold no version: /ready 503, and the follower re-syncs it from
    a keyframe."""
    import httpx

    have = world.latest
    engine, sc = _driven(server, world)
    try:
        deadline = time.monotonic() + 120
        seen, loaded = ready_then_hold_loads(sc.url, engine, deadline, hold_s=60)
        r = server.post("/update_weights_from_disk", {"model_path": str(world.model)})
        assert r["success"], r  # version 0's checkpoint, behind the sidecar's back
        while httpx.get(f"{sc.url}/ready").status_code != 503:
            assert time.monotonic() < deadline, "the weights written behind it were never noticed"
            time.sleep(0.02)
        # a caller that will not wait for the re-sync: refused, not served other words
        body = {"model": str(world.model), "prompt": "hi", "max_tokens": 2}
        body["rollpatch"] = {"wait_s": 0}
        r = httpx.post(f"{sc.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "audit found" in r.json()["error"]["message"], r.text
        seen.set()
        until_back_on(sc, have, deadline + 180)
        assert loaded == [have] and sc.sidecar.follower.status().audits >= 1
        assert engine.held(fresh=True)[1] == world.views[have].digest()
    finally:
        sc.stop()


def test_a_second_adapter_is_refused_while_a_sidecar_drives_sglang(
    server: vllm_env.Server, world: World
) -> None:
    """Two sidecars on one SGLang: before session 38 the second's load replaced the loader's
    weights and digests, the first's audit then passed against them, and the first labelled
    the second run's words with its own version (an audit's HIGH finding: 337 of 803
    responses). Now the loader has one owner: the second adapter is refused, naming why, and
    the first goes on serving its verified version; once it closed, another starts at once."""
    import httpx

    from rollpatch.engines.sglang import SglangEngine
    from rollpatch.errors import EngineError

    have = world.latest
    engine, sc = _driven(server, world)
    other = SglangEngine(server.url)
    try:
        until(lambda: httpx.get(f"{sc.url}/ready").status_code == 200, "the sidecar ready", 120)
        with pytest.raises(EngineError, match="driven by another rollpatch adapter"):
            other.load(world.views[0], 0)
        with pytest.raises(EngineError, match="driven by another rollpatch adapter"):
            other.boot_digest()
        # refused on the first one's control socket, before SGLang's weight-update routes,
        # which take its model-update writer lock (they stalled the first one's requests at
        # each try: an audit, session 40)
        locking = {"/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor"}
        assert not locking & set(other.channel.route_ms), other.channel.route_ms
        assert other.channel.displaced and other.version is None  # as a loader refusal does
        # SGLang paused (by hand here; a commit of the first one's in life): a second sidecar
        # that starts now is refused, and must not resume the owner's pause (a re-check,
        # session 40: its start-up resume ran before any ownership check)
        from rollpatch.sidecar import SidecarConfig
        from rollpatch.sidecar.server import make_engine, start_sidecar

        server.post("/pause_generation", {"mode": "retract"})
        try:
            eng2, url2 = make_engine("sglang", engine_url=server.url)
            start_sidecar(world.board, RUN, eng2, url2, config=SidecarConfig()).stop()
            assert httpx.get(f"{server.url}/ready").status_code == 503  # still paused
        finally:
            server.post("/continue_generation", {})
        time.sleep(0.3)  # audits run meanwhile: nothing changed under the sidecar
        assert httpx.get(f"{sc.url}/ready").status_code == 200
        assert sc.sidecar.follower.version == have and sc.sidecar.follower.status().audits == 0
        assert engine.held(fresh=True)[1] == world.views[have].digest()
    finally:
        sc.stop()  # closes its adapter: the loader is free at once
    try:
        other.channel.restart()
        assert other.boot_digest() == world.views[have].digest()
    finally:
        other.close()
