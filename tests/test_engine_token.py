"""An engine server started with ``--api-key`` (vLLM, SGLang): the sidecar's
``--engine-token-file`` token goes on every call its adapter makes and on every request it
proxies (before session 38 there was no way to send one: an SGLang with ``--api-key`` answered
the sidecar 401, so its weight-update routes had to stay open to any local caller).

A stdlib server stands in for the engine: it answers 401 without the bearer token, records
what it got, and the vLLM client, the SGLang client and the proxy's upstream each call it.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from rollpatch.engines.sglang.wire import http_json
from rollpatch.engines.vllm.client import Http
from rollpatch.errors import ConfigError, EngineError
from rollpatch.serving.upstream import Upstream
from rollpatch.sidecar.server import make_engine

TOKEN = "s3cret"


class _Guarded(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[str | None]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        got = self.headers.get("authorization")
        self.seen.append(got)
        ok = got == f"Bearer {TOKEN}"
        body = json.dumps({"ok": True} if ok else {"error": "Unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Guarded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Guarded.seen = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_adapters_and_the_proxy_send_the_engine_token(engine_url: str) -> None:
    # vLLM's client
    assert Http(engine_url, 5.0, token=TOKEN).get("/v1/models") == {"ok": True}
    with pytest.raises(EngineError, match="401"):
        Http(engine_url, 5.0).get("/v1/models")
    # SGLang's
    assert http_json(engine_url, "GET", "/server_info", timeout=5.0, token=TOKEN) == {"ok": True}
    with pytest.raises(EngineError, match="SGLang answered 401"):
        http_json(engine_url, "GET", "/server_info", timeout=5.0)

    # the proxy's upstream: the token on every request, beside the request's own headers
    async def proxied() -> tuple[int, int]:
        up = Upstream(
            engine_url,
            connect_s=5,
            max_connections=2,
            headers=[(b"authorization", f"Bearer {TOKEN}".encode())],
        )
        try:
            ok = await up.request("POST", "/v1/completions", b"{}", [(b"content-type", b"x")])
            await ok.read()
            bare = Upstream(engine_url, connect_s=5, max_connections=2)
            refused = await bare.request("POST", "/v1/completions", b"{}")
            await refused.read()
            await bare.aclose()
            return ok.status, refused.status
        finally:
            await up.aclose()

    assert asyncio.run(proxied()) == (200, 401)
    assert _Guarded.seen.count(f"Bearer {TOKEN}") == 3 and _Guarded.seen.count(None) == 3


def test_the_token_reaches_the_adapters_and_only_remote_engines_take_one(engine_url: str) -> None:
    for kind in ("vllm", "sglang"):
        engine, _ = make_engine(kind, engine_url=engine_url, engine_token=TOKEN)
        try:
            assert engine.engine_token == TOKEN
        finally:
            engine.close()
    with pytest.raises(ConfigError, match="--engine-token-file is for --engine vllm or sglang"):
        make_engine("reference", model="m", engine_token=TOKEN)


def test_an_engine_that_refuses_the_token_is_said_at_start_and_by_ready(
    engine_url: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine's --api-key covers its OpenAI routes only: with a wrong or missing token
    the sidecar's weight calls and health probe worked, /ready said 200, and every request
    it proxied got 401 (an audit's MEDIUM finding, session 39). Now the CLI refuses to start
    (exit 2, one line naming the flag) and /ready's engine probe (``/v1/models``) says why."""
    from rollpatch.cli import main
    from rollpatch.sidecar.app import _probe_engine

    board = f"file://{tmp_path / 'board'}"
    (tmp_path / "board").mkdir()
    wrong = tmp_path / "wrong.token"
    wrong.write_text("nope\n")
    base = ["sidecar", "--board", board, "--run", "r", "--engine", "vllm"]
    for token in ([], ["--engine-token-file", str(wrong)]):
        assert main([*base, "--engine-url", engine_url, "--port", "0", *token]) == 2
        err = capsys.readouterr().err
        assert "the engine refuses the sidecar's requests (HTTP 401 on /v1/models)" in err, err
        assert "--engine-token-file" in err and "Traceback" not in err

    async def probe(token: str) -> str | None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=engine_url, headers=headers) as client:
            return await _probe_engine(client, 5.0)

    assert "HTTP 401 on /v1/models" in (asyncio.run(probe("nope")) or "")
    assert asyncio.run(probe(TOKEN)) is None


def test_a_bad_token_file_is_named_by_its_flag(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four services take token files: an error said only "the token file ..." and the path
    (an audit's LOW finding, session 39); it now names the flag."""
    from rollpatch.cli import main

    (tmp_path / "board").mkdir()
    empty = tmp_path / "empty"
    empty.write_text("")
    base = ["sidecar", "--board", f"file://{tmp_path / 'board'}", "--run", "r", "--port", "0"]
    for flag in ("--engine-token-file", "--admin-token-file", "--token-file"):
        argv = [*base, "--engine", "vllm", "--engine-url", "http://127.0.0.1:9", flag, str(empty)]
        assert main(argv) == 2
        assert f"the {flag} file is empty" in capsys.readouterr().err
