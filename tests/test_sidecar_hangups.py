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
