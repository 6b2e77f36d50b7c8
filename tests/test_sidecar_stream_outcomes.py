"""How a streamed answer is counted (audit G-F1): a stream whose end (``[DONE]``) reached the
client is ``proxied`` and timed in ``rollpatch_proxy_seconds``, even when the client hangs up
before the sidecar reads the engine's own end (the ``openai`` client closes its connection
right after ``[DONE]``); a client that leaves before the end is ``client_gone``. The real
``openai`` client over real sockets: in front of the scripted engine of
tests/test_sidecar_tap_live.py (the engine's last chunk held back, so the client is always
gone first), relayed by the tap and by the request's task, and in front of the built-in engine.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the dev extra installs openai")

from rollpatch.sidecar.proxy import ProxyFront
from rollpatch.sidecar.server import RunningSidecar
from tests.sidecarfix import MODEL, sidecar, world
from tests.test_sidecar_tap_live import _HEAD, Engine, _outcomes, endless, live, taps

_FIXTURES = (live, taps, sidecar, world)  # used by name

_DONE_CHUNK = b"e\r\ndata: [DONE]\n\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


def _event(i: int) -> bytes:
    obj = {
        "id": "c",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None, "logprobs": None}],
    }
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


def _timed(sc: RunningSidecar) -> float:
    """How many answers ``rollpatch_proxy_seconds`` has timed."""
    value = sc.sidecar.metrics.registry.get_sample_value("rollpatch_proxy_seconds_count")
    return value or 0.0


def _client(sc: RunningSidecar) -> Any:
    return openai.OpenAI(base_url=f"{sc.url}/v1", api_key="-", max_retries=0, timeout=30)


def _read_to_the_end(client: Any, i: int) -> dict[str, Any]:
    """One streamed completion read to its end; the rollpatch versions of its last chunk."""
    meta: dict[str, Any] = {}
    stream = client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=4, stream=True)
    for chunk in stream:
        meta = (chunk.model_extra or {}).get("rollpatch") or meta
    return meta


def _settled(sc: RunningSidecar, before: dict[str, int], n: int) -> dict[str, int]:
    """The outcomes since ``before`` once ``n`` are counted (each is counted at its end)."""
    deadline = time.monotonic() + 10
    while sum(_outcomes(sc, before).values()) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return _outcomes(sc, before)


@pytest.mark.parametrize("tapped", [True, False], ids=["tap", "task"])
def test_openai_streams_read_to_the_end_are_proxied(
    live: tuple[Engine, RunningSidecar],
    taps: list[int],
    monkeypatch: pytest.MonkeyPatch,
    tapped: bool,
) -> None:
    """The engine sends ``[DONE]`` and holds its last chunk back 50 ms (or sends both at
    once, every third stream): the openai client has hung up before the sidecar reads the
    engine's end, and every stream still counts ``proxied`` and is timed."""
    engine, sc = live
    if not tapped:
        monkeypatch.setattr(ProxyFront, "tap_streams", False)

    def script(n: int, t: Any) -> None:
        t.write(_HEAD + _event(0))
        engine.later(0.002, lambda: t.write(_event(1) + _event(2)))
        if n % 3 == 0:
            engine.later(0.004, lambda: t.write(_DONE_CHUNK + _LAST_CHUNK))
            return
        engine.later(0.004, lambda: t.write(_DONE_CHUNK))
        engine.later(0.054, lambda: None if t.is_closing() else t.write(_LAST_CHUNK))

    engine.script = script
    n = 24
    before, timed = _outcomes(live[1]), _timed(sc)
    client = _client(sc)
    try:
        metas = [_read_to_the_end(client, i) for i in range(n)]
    finally:
        client.close()
    assert metas == [{"version_start": 0, "version_end": 0}] * n  # every one whole, labelled
    assert _settled(sc, before, n) == {"proxied": n}  # none counted client_gone
    assert _timed(sc) == timed + n
    assert taps[0] == (n if tapped else 0)
    deadline = time.monotonic() + 10
    while sc.sidecar.gate.inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sc.sidecar.gate.inflight == 0


@pytest.mark.parametrize("tapped", [True, False], ids=["tap", "task"])
def test_an_openai_client_leaving_mid_stream_is_client_gone(
    live: tuple[Engine, RunningSidecar],
    taps: list[int],
    monkeypatch: pytest.MonkeyPatch,
    tapped: bool,
) -> None:
    """A client that closes its stream before the end stays ``client_gone``, untimed."""
    engine, sc = live
    if not tapped:
        monkeypatch.setattr(ProxyFront, "tap_streams", False)

    endless(engine, _event)
    before, timed = _outcomes(sc), _timed(sc)
    client = _client(sc)
    try:
        stream = client.completions.create(model=MODEL, prompt="p", max_tokens=4, stream=True)
        got = []
        for chunk in stream:
            got.append(chunk.choices[0].text)
            if len(got) == 3:
                break
        stream.close()
    finally:
        client.close()
    assert got == [" t0", " t1", " t2"]
    assert _settled(sc, before, 1) == {"client_gone": 1}
    assert _timed(sc) == timed
    assert taps[0] == (1 if tapped else 0)


def test_openai_streams_from_the_built_in_engine_are_proxied(sidecar: RunningSidecar) -> None:
    """The long-run audit's case: many streams from the built-in engine, read to the end by
    the openai client, all ``proxied`` and timed."""
    n = 20
    before, timed = _outcomes(sidecar), _timed(sidecar)
    client = _client(sidecar)
    try:
        metas = [_read_to_the_end(client, i) for i in range(n)]
    finally:
        client.close()
    assert all(m.get("version_end") is not None for m in metas)
    assert _settled(sidecar, before, n) == {"proxied": n}
    assert _timed(sidecar) == timed + n
