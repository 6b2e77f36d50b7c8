"""The gateway against buggy or hostile islands (audit p39a, findings 3 and 4): answers whose
version labels break the request's constraint, answers without labels or not JSON, answers
and stream lines over the size bounds. Islands are small real HTTP servers (:class:`Fake`);
requests go through the real ``openai`` client. Polls, runs, heads: test_gateway_fleet.py."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("openai", reason="the dev extra installs openai")

import httpx
import openai

from rollpatch.gateway import GatewayConfig
from rollpatch.gateway.server import RunningGateway, start_gateway
from tests.conftest import until

Post = Callable[["Handler", dict[str, Any]], None]
CONFIG = GatewayConfig(poll_s=0.05, poll_timeout_s=1.0, retry_backoff_s=0.01)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: Fake

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/version":
            self.reply(404, {"error": {"message": "no route"}})
        elif self.fake.version_get is not None:
            self.fake.version_get(self)
        else:
            self.reply(200, self.fake.version)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.fake.posts.append(body)
        self.fake.post(self, body)

    def reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def events(self, events: list[bytes], headers: dict[str, str]) -> None:
        """A stream: ``events`` (whole ``data: ...\\n\\n`` blocks), then the connection ends."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        for e in events:
            self.wfile.write(e)
            self.wfile.flush()
        self.close_connection = True


class Fake:
    """A fake island: ``/version`` answers ``version`` (or ``version_get(handler)``), each POST
    is recorded in :attr:`posts` and answered by ``post(handler, body)``."""

    def __init__(
        self,
        post: Post,
        served: int = 1,
        latest: int | None = None,
        run: str = "r1",
        version_get: Callable[[Handler], None] | None = None,
    ) -> None:
        self.version = {
            "run": run,
            "served": served,
            "latest": served if latest is None else latest,
            "state": "IDLE",
            "lag": 0,
        }
        self.post, self.version_get = post, version_get
        self.posts: list[dict[str, Any]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Handler,), {"fake": self}))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def completion(start: int | None, end: int | None, *, labels: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "x",
        "object": "text_completion",
        "created": 0,
        "model": "model",
        "choices": [{"index": 0, "text": " a", "finish_reason": "length", "logprobs": None}],
    }
    if labels:
        body["rollpatch"] = {"version_start": start, "version_end": end}
    return body


def version_headers(start: int | None, end: int | None) -> dict[str, str]:
    out = {} if start is None else {"X-Rollpatch-Version-Start": str(start)}
    return out if end is None else {**out, "X-Rollpatch-Version-End": str(end)}


def labelled(version: int, header: int | None = None) -> Post:
    """A POST answered ``200`` labelled ``version`` (headers: ``header``, default the same),
    streamed when asked."""
    h = version if header is None else header

    def post(handler: Handler, body: dict[str, Any]) -> None:
        if body.get("stream"):
            last = {**completion(version, version)}
            handler.events(
                [b"data: " + json.dumps(last).encode() + b"\n\n", b"data: [DONE]\n\n"],
                version_headers(h, h),
            )
        else:
            handler.reply(200, completion(version, version), version_headers(h, h))

    return post


@pytest.fixture
def fakes() -> Iterator[list[Fake]]:
    made: list[Fake] = []
    yield made
    for f in made:
        f.stop()


def gateway(islands: dict[str, Fake], config: GatewayConfig = CONFIG) -> RunningGateway:
    return start_gateway([f"{n}={f.url}" for n, f in islands.items()], config=config)


def client(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def sample(gw: RunningGateway, island: str, outcome: str) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(
        "rollpatch_gateway_requests_total", {"island": island, "outcome": outcome}
    )
    return 0.0 if value is None else value


def complete(c: openai.OpenAI, **rollpatch: Any) -> dict[str, Any]:
    out = c.completions.create(
        model="model", prompt="x", max_tokens=2, extra_body={"rollpatch": rollpatch}
    )
    return out.model_dump()["rollpatch"]  # type: ignore[no-any-return]


# ---- labels (finding 3) ---------------------------------------------------------------------


def test_a_mislabelled_answer_is_refused_and_retried_on_an_honest_island(
    fakes: list[Fake], caplog: pytest.LogCaptureFixture
) -> None:
    """A liar claims to serve 1 and answers labelled 0: its answers never reach the client;
    the request is retried on an honest island, the liar counted ``bad_label``, penalized and
    logged."""
    caplog.set_level(logging.INFO, logger="rollpatch.gateway")
    fakes += [Fake(labelled(0)), Fake(labelled(1))]
    gw = gateway({"liar": fakes[0], "honest": fakes[1]})
    try:
        c = client(gw)
        got = [complete(c, exact_version=1) for _ in range(4)]
        assert got == [{"version_start": 1, "version_end": 1, "island": "honest"}] * 4, got
        assert fakes[0].posts, "the rotation sends some first tries to the liar"
        assert sample(gw, "liar", "bad_label") == len(fakes[0].posts)
        assert sample(gw, "liar", "ok") == 0
        liar = next(i for i in httpx.get(f"{gw.url}/islands").json()["islands"])
        assert "bad answer (bad_label)" in liar["penalized"], liar
        assert any(
            getattr(r, "rp_event", None) == "bad_answer" and r.levelno == logging.WARNING
            for r in caplog.records
        )
    finally:
        gw.stop()


def _lone(fakes: list[Fake], post: Post, **kw: Any) -> RunningGateway:
    fakes.append(Fake(post, **kw))
    return gateway({"solo": fakes[-1]})


@pytest.mark.parametrize(
    ("post", "rollpatch"),
    [
        (labelled(0), {"exact_version": 1}),  # wrong version, headers and body agree
        (labelled(0), {"min_version": 1}),
        (labelled(1, header=2), {}),  # headers and body disagree
        (lambda h, b: h.reply(200, completion(1, 1, labels=False), version_headers(1, 1)), {}),
        (lambda h, b: h.reply(200, completion(1, 1), {}), {}),  # body labels, no headers
        (lambda h, b: h.reply(200, b"<html>not json", {"X-Rollpatch-Version-End": "abc"}), {}),
        (lambda h, b: h.reply(200, completion(True, 1), version_headers(1, 1)), {}),
    ],
    ids=["exact", "min", "disagree", "no-body-labels", "no-headers", "not-json", "bool"],
)
def test_a_lone_island_with_bad_labels_gets_a_502(
    fakes: list[Fake], post: Post, rollpatch: dict[str, Any]
) -> None:
    gw = _lone(fakes, post)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            complete(client(gw), **rollpatch)
        assert e.value.status_code == 502
        error = e.value.response.json()["error"]
        assert error["type"] == "island_error" and "gateway refused" in error["message"]
        assert sample(gw, "solo", "bad_label") == CONFIG.max_attempts
        assert sample(gw, "solo", "ok") == 0
    finally:
        gw.stop()


def test_max_lag_is_checked_against_the_islands_latest(fakes: list[Fake]) -> None:
    """The island reports LATEST 5: an answer labelled 3 breaks ``max_lag: 1``; 4 does not."""
    gw = _lone(fakes, labelled(3), served=5, latest=5)
    try:
        assert complete(client(gw), max_lag=2)["version_start"] == 3
        with pytest.raises(openai.APIStatusError) as e:
            complete(client(gw), max_lag=1)
        assert e.value.status_code == 502
    finally:
        gw.stop()


def _stream(gw: RunningGateway, **rollpatch: Any) -> list[str]:
    body = {"prompt": "x", "max_tokens": 2, "stream": True, "rollpatch": rollpatch}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line.startswith("data:")]


def test_a_stream_whose_head_breaks_the_constraint_is_refused_before_a_byte(
    fakes: list[Fake],
) -> None:
    gw = _lone(fakes, labelled(0))
    try:
        with pytest.raises(openai.APIStatusError) as e:
            stream = client(gw).completions.create(
                model="model", prompt="x", max_tokens=2, stream=True,
                extra_body={"rollpatch": {"exact_version": 1}},
            )  # fmt: skip
            list(stream)
        assert e.value.status_code == 502
        assert sample(gw, "solo", "bad_label") == CONFIG.max_attempts
    finally:
        gw.stop()


@pytest.mark.parametrize(
    "events",
    [
        [completion(1, 1), completion(0, 0)],  # the final label contradicts the head
        [completion(1, 1, labels=False)],  # no label at all
    ],
    ids=["contradicts", "unlabelled"],
)
def test_a_stream_with_bad_labels_ends_with_an_error_event_not_done(
    fakes: list[Fake], events: list[dict[str, Any]]
) -> None:
    def post(h: Handler, body: dict[str, Any]) -> None:
        blocks = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
        h.events([*blocks, b"data: [DONE]\n\n"], version_headers(1, 1))

    gw = _lone(fakes, post)
    try:
        lines = _stream(gw, exact_version=1)
        assert lines[-1] != "data: [DONE]", lines
        assert "gateway refused" in json.loads(lines[-1][5:])["error"]["message"]
        assert not any('"version_start": 0' in line for line in lines), lines
        assert sample(gw, "solo", "bad_label") == 1
        with pytest.raises(openai.APIError):  # the openai client sees the error
            list(client(gw).completions.create(model="model", prompt="x", stream=True))
    finally:
        gw.stop()


def test_honest_streams_pass_with_their_labels_and_island(fakes: list[Fake]) -> None:
    gw = _lone(fakes, labelled(1))
    try:
        chunks = list(client(gw).completions.create(model="model", prompt="x", stream=True))
        rp = (chunks[-1].model_extra or {})["rollpatch"]
        assert rp == {"version_start": 1, "version_end": 1, "island": "solo"}
        assert sample(gw, "solo", "ok") == 1 and sample(gw, "solo", "bad_label") == 0
    finally:
        gw.stop()


# ---- size bounds (finding 4) ----------------------------------------------------------------

SMALL = GatewayConfig(
    poll_s=0.05, retry_backoff_s=0.01, max_attempts=1, max_answer_bytes=4096, max_event_bytes=2048
)


def _huge(h: Handler, body: dict[str, Any], *, length: bool) -> None:
    h.send_response(200)
    h.send_header("content-type", "application/json")
    for k, v in version_headers(1, 1).items():
        h.send_header(k, v)
    h.send_header(
        "content-length" if length else "connection", str(64 << 20) if length else "close"
    )
    h.end_headers()
    h.fake_sent = pour(h, b"a", 64 << 20)  # type: ignore[attr-defined]
    h.close_connection = True


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "until-close"])
def test_an_answer_over_max_answer_bytes_is_a_502_and_not_read_whole(
    fakes: list[Fake], length: bool
) -> None:
    sent: list[int] = []

    def post(h: Handler, body: dict[str, Any]) -> None:
        _huge(h, body, length=length)
        sent.append(h.fake_sent)  # type: ignore[attr-defined]

    fakes.append(Fake(post))
    gw = gateway({"big": fakes[-1]}, SMALL)
    try:
        r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 502 and "over the limit of 4,096" in r.text, r.text
        assert sample(gw, "big", "too_large") == 1
        until(lambda: sent, "the island to stop writing")
        assert sent[0] < 64 << 20, "the gateway stopped reading"
    finally:
        gw.stop()


def test_a_stream_line_over_max_event_bytes_ends_the_stream_with_an_error(
    fakes: list[Fake],
) -> None:
    def post(h: Handler, body: dict[str, Any]) -> None:
        first = b"data: " + json.dumps(completion(1, 1, labels=False)).encode() + b"\n\n"
        h.events([first, b"data: " + b"x" * 100_000], version_headers(1, 1))

    fakes.append(Fake(post))
    gw = gateway({"big": fakes[-1]}, SMALL)
    try:
        lines = _stream(gw)
        assert len(lines) == 2 and "over the limit of 2,048" in lines[-1], lines
        assert sample(gw, "big", "too_large") == 1
    finally:
        gw.stop()


def test_an_answer_whose_end_the_sidecar_cannot_vouch_for_passes(fakes: list[Fake]) -> None:
    """``version_end`` null, no End header (docs/sidecar.md: the engine was lost mid-answer):
    the sidecar's honest answer, passed on as it is."""
    gw = _lone(fakes, lambda h, b: h.reply(200, completion(1, None), version_headers(1, None)))
    try:
        assert complete(client(gw), exact_version=1) == {
            "version_start": 1,
            "version_end": None,
            "island": "solo",
        }
        assert sample(gw, "solo", "bad_label") == 0
    finally:
        gw.stop()


def pour(h: Handler, byte: bytes, total: int) -> int:
    """Write ``total`` bytes of ``byte`` to the client 64 KiB at a time, until it hangs up;
    how many were written."""
    sent = 0
    try:
        while sent < total:
            h.wfile.write(byte * 65536)
            sent += 65536
    except OSError:
        pass
    return sent
