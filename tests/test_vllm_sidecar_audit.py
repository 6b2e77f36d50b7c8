"""vLLM behind the follower, live: the follower hands the workers every step undecoded (a
catch-up composed and proven in the worker, one engine-core call per commit), and the
background audit finds a bit flipped behind the sidecar's back, takes the island out of
rotation and re-syncs it (the world: tests/sidecarworld.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from rollpatch.engines.fit import tensors_of_view
from rollpatch.follower import Follower, FollowerConfig
from tests import vllm_env
from tests.sidecarworld import (
    FAST,
    RUN,
    World,
    ready_then_hold_loads,
    server,
    until_back_on,
    world,
)

_FIXTURES = (server, world)  # used by name


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
    # what a keyframe's headers are checked against (rollpatch.engines.fit)
    assert engine.model_tensors() == tensors_of_view(world.views[world.latest])
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
        seen, loaded = ready_then_hold_loads(sc.url, engine, deadline)
        auditor = sc.sidecar.follower.auditor
        assert auditor is not None
        before = auditor.bytes
        names = sorted(engine.tensors())
        name = names[len(names) // 2]
        out = server.post("/collective_rpc", {"method": "rollpatch_flip", "args": [name, "7"]})
        assert out["results"][0]["ok"] and out["results"][0]["flipped"] == 1
        # the audit's 503: a 503 before the audit found the bit is another one (under load,
        # /ready's probe of the engine's /health can time out once: "engine unreachable")
        while not (
            auditor.bytes_at_first_mismatch is not None
            and httpx.get(f"{sc.url}/ready").status_code == 503
        ):
            assert time.monotonic() < deadline + 60, "the audit never found the flipped bit"
            time.sleep(0.01)
        # counted when the audit found it (this poll of /ready may see the 503 late under load,
        # while the auditor goes on with other engines' work)
        hashed = auditor.bytes_at_first_mismatch - before
        seen.set()
        until_back_on(sc, world.latest, deadline + 120)
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


def test_a_vllm_restarted_under_the_sidecar_is_taken_out_and_re_synced(
    server: vllm_env.Server, world: World
) -> None:
    """A vLLM restarted under a running sidecar boots its checkpoint and has no rollpatch
    state: before, the sidecar went on labelling its answers with the version it had
    committed (140 s in a newcomer's repro, until the next publish). The workers' state
    now carries a boot identity the adapter checks at every audit: the restart (here the
    state dropped by fault injection, as a restart leaves it) takes the island out of
    rotation and the follower re-syncs it from a keyframe by itself."""
    import httpx

    from rollpatch.engines.vllm import VllmEngine
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    engine = VllmEngine(server.url)
    engine.load(world.views[world.latest], world.latest)
    cfg = FollowerConfig(
        poll_s=0.05, backoff_s=0.01, timeout_s=60.0, audit_bytes_per_s=2**20, audit_period_s=0.05
    )
    sc = start_sidecar(world.board, RUN, engine, server.url, config=SidecarConfig(follower=cfg))
    try:
        deadline = time.monotonic() + 60
        seen, loaded = ready_then_hold_loads(sc.url, engine, deadline)
        out = server.post("/collective_rpc", {"method": "rollpatch_forget", "args": []})
        assert out["results"][0]["ok"] and out["results"][0]["forgot"]
        while httpx.get(f"{sc.url}/ready").status_code != 503:
            assert time.monotonic() < deadline + 60, "the restart was never noticed"
            time.sleep(0.01)
        seen.set()
        until_back_on(sc, world.latest, deadline + 120)
        assert loaded == [world.latest] and sc.sidecar.follower.status().audits == 1
        assert engine.held(fresh=True)[1] == world.views[world.latest].digest()
    finally:
        sc.stop()


def test_one_adapter_drives_a_vllm_at_a_time(server: vllm_env.Server, world: World) -> None:
    """Two adapters on one vLLM (two sidecars): before, the second's load wrote the workers'
    words and digests, and the first went on labelling them with its own version until its
    next audit. Now the workers take one adapter's calls (:mod:`rollpatch.engines.ownership`):
    the second's load is refused before it pauses or writes anything, the first keeps its
    version and a clean audit; once the first closes, the second loads, and the first's calls
    are refused from then on, its version void (the engine's tag is the second one's)."""
    import pytest

    from rollpatch.engines.vllm import VllmEngine
    from rollpatch.errors import EngineError

    first, second = VllmEngine(server.url), VllmEngine(server.url)
    try:
        first.load(world.views[world.latest], world.latest)
        assert first.audit(2**30).mismatched == () and first.version == world.latest
        with pytest.raises(EngineError, match="driven by another rollpatch adapter") as refused:
            second.load(world.views[0], 0)
        assert refused.value.context["other_adapter"] is True and second.version is None
        assert first.audit(2**30).mismatched == () and first.version == world.latest
        assert server.get("/weight_info") == {"weight_version": str(world.latest)}
        first.close()  # lets go at once
        second.load(world.views[0], 0)
        assert second.held(fresh=True)[1] == world.views[0].digest() and second.version == 0
        with pytest.raises(EngineError, match="driven by another rollpatch adapter"):
            first.audit(2**30)
        assert first.version is None and first.displaced
        assert server.get("/weight_info") == {"weight_version": "0"}  # untouched by the first
        second.close()
        # an adapter in a process killed -9 (a sidecar with no chance to let go), which
        # called the workers every 0.1 s to its end: the next one takes over at once (its
        # process is gone in /proc), not after the 5 s lease
        script = (
            "import sys, time\nfrom rollpatch.engines.vllm import VllmEngine\n"
            f"e = VllmEngine({server.url!r})\nwhile True:\n"
            "    e.held()\n    print('called', flush=True)\n    time.sleep(0.1)\n"
        )
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "called"
            third = VllmEngine(server.url)
            with pytest.raises(EngineError, match="driven by another rollpatch adapter"):
                third.held()  # it runs: refused
            child.kill()
            child.wait(30)
            third.load(world.views[world.latest], world.latest)
            assert third.version == world.latest
            third.close()
        finally:
            child.kill()
            child.wait(30)
    finally:
        first.close()
        second.close()


def test_a_vllm_paused_behind_the_sidecar_is_not_ready(
    server: vllm_env.Server, world: World
) -> None:
    """vLLM paused through its own ``/pause`` while no commit of the sidecar runs: its
    requests wait until someone resumes it, and /ready said 200 (audit D, session 39). Now
    /ready is 503 with the reason while it is paused, and 200 once it is resumed."""
    import httpx

    from rollpatch.engines.vllm import VllmEngine
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    engine = VllmEngine(server.url)
    engine.load(world.views[world.latest], world.latest)
    sc = start_sidecar(world.board, RUN, engine, server.url, config=SidecarConfig(follower=FAST))
    try:
        until_back_on(sc, world.latest, time.monotonic() + 60)
        server.post("/pause?mode=keep", {})
        try:
            r = httpx.get(f"{sc.url}/ready")
            assert r.status_code == 503 and "not by this sidecar" in r.json()["error"]["message"]
            # a second sidecar starting now is refused the engine: it must not resume the
            # owner's pause (found by a re-check, session 40)
            other = start_sidecar(
                world.board, RUN, VllmEngine(server.url), server.url, config=SidecarConfig()
            )
            other.stop()
            assert server.get("/is_paused") == {"is_paused": True}
        finally:
            server.post("/resume", {})
        until_back_on(sc, world.latest, time.monotonic() + 60)
    finally:
        sc.stop()
    # a sidecar that starts on a paused vLLM (one before it died inside a pause-mode commit:
    # audit E, session 40, on SGLang) resumes it: no request waits for the next commit
    server.post("/pause?mode=keep", {})
    try:
        sc = start_sidecar(
            world.board,
            RUN,
            VllmEngine(server.url),
            server.url,
            config=SidecarConfig(follower=FAST),
        )
        try:
            assert server.get("/is_paused") == {"is_paused": False}
            until_back_on(sc, world.latest, time.monotonic() + 60)
        finally:
            sc.stop()
    finally:
        server.post("/resume", {})


def test_a_hung_up_plain_request_ends_in_vllm_too(server: vllm_env.Server, world: World) -> None:
    """A client that hangs up on a request that is not streamed: the sidecar closes its
    connection to vLLM, and vLLM aborts the request (its handlers watch for a disconnect),
    so nothing runs on for a client that is gone (audit C, session 39; the built-in engine:
    tests/test_sidecar_hangups.py). vLLM is held paused while the request reaches it and the
    client hangs up, so the generation cannot end first however fast this host is."""
    import socket

    import httpx

    from rollpatch.engines.vllm import VllmEngine
    from rollpatch.engines.vllm.core import SCHEDULER
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    def generated() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:generation_tokens_total{", "vllm:generation_tokens_total "))
        )

    def queued() -> int:
        """vLLM's requests, running or waiting (the engine-core hook's exact counts)."""
        r = httpx.post(f"{server.url}/collective_rpc", json={"method": SCHEDULER}, timeout=60)
        counts = r.json()["results"][0]
        return int(counts["running"]) + int(counts["waiting"])

    engine = VllmEngine(server.url)
    engine.load(world.views[world.latest], world.latest)
    sc = start_sidecar(world.board, RUN, engine, server.url, config=SidecarConfig(follower=FAST))
    try:
        until_back_on(sc, world.latest, time.monotonic() + 60)
        body = json.dumps(
            {
                "model": str(world.model),
                "prompt": "a",
                "max_tokens": 480,  # the server's 512-token context, nearly all of it
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        host, port = sc.url.removeprefix("http://").split(":")
        before = generated()
        server.post("/pause?mode=keep", {})  # it waits in vLLM's queue, whatever this host's speed
        try:
            client = socket.create_connection((host, int(port)))
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            deadline = time.monotonic() + 60
            while not queued():
                if time.monotonic() > deadline:  # say what the sidecar answered, if anything
                    client.settimeout(1.0)
                    try:
                        got = client.recv(65536)
                    except OSError as e:
                        got = repr(e).encode()
                    raise AssertionError(f"the request never reached vLLM: {got[:500]!r}")
                time.sleep(0.02)
            client.close()  # the client hangs up
            while sc.sidecar.gate.inflight:
                assert time.monotonic() < deadline, "the sidecar held the hung-up request"
                time.sleep(0.02)
        finally:
            server.post("/resume", {})
        while queued():
            assert time.monotonic() < deadline, "the abandoned request ran on"
            time.sleep(0.05)
        assert generated() - before < 480, "vLLM ran the abandoned request to its end"
    finally:
        sc.stop()
