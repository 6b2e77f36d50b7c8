"""A client that hangs up on a request that is not streamed: the sidecar ends the engine's
request (its connection closed, as for a stream), so the abandoned generation holds no slot,
no drain and no commit (an audit's MEDIUM finding, session 39: in drain mode three such
requests held the next version, and every request behind it, for about 27 s)."""

from __future__ import annotations

import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")
pytest.importorskip("transformers", reason="the reference extra installs transformers")

import httpx

from tests.conftest import until
from tests.sidecarfix import MODEL, PROMPT, World, _start, _wait_ready, world

_FIXTURES = (world,)  # used by name


def test_a_hung_up_plain_request_ends_its_generation_and_frees_the_drain(world: World) -> None:
    sc = _start(world, mode="drain")
    try:
        _wait_ready(sc)
        rt, gate = sc.sidecar.engine.runtime, sc.sidecar.gate  # type: ignore[attr-defined]
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 4000,  # seconds of generation on this engine
            "temperature": 0,
            "ignore_eos": True,
        }
        made = rt.state()["tokens_generated"]
        with pytest.raises(httpx.ReadTimeout):  # the client hangs up after 1 s
            httpx.post(f"{sc.url}/v1/completions", json=body, timeout=1.0)
        until(lambda: gate.inflight == 0, "the sidecar to let the hung-up request go")
        until(lambda: rt.state()["in_flight"] == 0, "the engine's generation to end")
        assert rt.state()["tokens_generated"] - made < 4000  # cut short, not run to its end
        metrics = httpx.get(f"{sc.url}/metrics").text
        assert 'rollpatch_requests_total{outcome="client_gone"} 1.0' in metrics
        v = world.publish()  # a drain commit is not held by it
        until(lambda: sc.sidecar.follower.version == v, "the next version to be served")
    finally:
        sc.stop()


def test_an_engine_that_stops_answering_its_audit_is_not_ready(world: World) -> None:
    """A wedged engine (audit D, session 39: one tensor-parallel rank killed, the collective
    hung) answered no audit call while /ready stayed 200 and requests hung. An audit slice
    unanswered for ``engine_stall_s`` now makes the island not ready, with the reason; the
    answer coming back makes it ready again. (The wedge here: the adapter's audit blocked.)"""
    import threading

    from rollpatch.engines.reference import ReferenceEngine
    from rollpatch.follower import FollowerConfig
    from rollpatch.sidecar import SidecarConfig
    from rollpatch.sidecar.server import start_sidecar

    engine = ReferenceEngine.from_dir(world.model, threads=1)
    wedged, audit = threading.Event(), engine.audit

    def hanging(budget: int) -> object:
        while wedged.is_set():
            threading.Event().wait(0.01)
        return audit(budget)

    engine.audit = hanging  # type: ignore[method-assign]
    follower = FollowerConfig(poll_s=0.05, audit_bytes_per_s=1e6, audit_period_s=0.05)
    config = SidecarConfig(engine_stall_s=0.5, follower=follower)
    sc = start_sidecar(world.board, "r1", engine, engine.url, config=config)
    try:
        _wait_ready(sc)
        wedged.set()
        until(
            lambda: httpx.get(f"{sc.url}/ready").status_code == 503,
            "the wedged engine to be taken out",
        )
        said = httpx.get(f"{sc.url}/ready").json()["error"]["message"]
        assert "has not answered an audit call for" in said, said
        wedged.clear()
        _wait_ready(sc)
    finally:
        wedged.clear()
        sc.stop()


def test_an_engine_paused_behind_the_sidecar_is_not_ready_and_resumed_at_start() -> None:
    """vLLM paused by someone else (its ``/pause``) while no commit of the sidecar runs: every
    request waits until it is resumed, and /ready said 200 (audit D, session 39). The probe
    behind /ready now asks vLLM's ``GET /is_paused``; an engine without it says nothing."""
    import asyncio
    import http.server
    import json
    import threading

    answers = {"/is_paused": (200, {"is_paused": True})}

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answers.get(self.path, (404, {"detail": "Not Found"}))
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    from rollpatch.engines import ViewEngine
    from rollpatch.sidecar.paused import paused_behind, resume_left_paused

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    async def probe() -> str | None:
        async with httpx.AsyncClient(base_url=url) as client:
            return await paused_behind(client, 5.0)

    try:
        assert "vLLM is paused, and not by this sidecar" in (asyncio.run(probe()) or "")
        answers["/is_paused"] = (200, {"is_paused": False})
        assert asyncio.run(probe()) is None
        del answers["/is_paused"]  # an older vLLM, or another engine
        assert asyncio.run(probe()) is None
        # SGLang: no /is_paused; its own /ready is 503 while paused, /ping 200 while healthy
        # (a killed sidecar left it paused: audit E, session 40)
        answers["/ready"], answers["/ping"] = (503, {}), (200, {})
        assert "the engine is paused, and not by this sidecar" in (asyncio.run(probe()) or "")
        answers["/ping"] = (503, {})  # not healthy: the engine probe says so, not this one
        assert asyncio.run(probe()) is None
        answers["/ping"] = (200, {})
        calls: list[str] = []

        class Adapter(ViewEngine):  # an adapter whose pause and resume use the routes
            def pause(self) -> None:
                calls.append("pause")

            def resume(self) -> None:
                calls.append("resume")
                answers["/ready"] = (200, {})

        adapter = Adapter()
        assert resume_left_paused(adapter, url, None, 5.0) is True
        assert calls == ["pause", "resume"] and asyncio.run(probe()) is None
        assert resume_left_paused(adapter, url, None, 5.0) is False  # not paused: untouched
        assert calls == ["pause", "resume"]
    finally:
        server.shutdown()
        server.server_close()
