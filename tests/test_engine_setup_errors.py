"""What a user who starts an engine slightly wrong is told (a newcomer's audit, session 36):
an OpenAI base URL given for ``--engine-url``, a vLLM started without rollpatch's worker
extension."""

from __future__ import annotations

from typing import Any

import pytest

from rollpatch.errors import EngineError


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_an_openai_base_url_is_taken_as_the_server(kind: str) -> None:
    """``--engine-url http://host:8000/v1`` (what its help used to call it) reached vLLM's
    /v1/collective_rpc: an unexplained 404. The /v1 is dropped."""
    from rollpatch.sidecar.server import make_engine

    engine, url = make_engine(kind, engine_url="http://127.0.0.1:9/v1/")
    try:
        assert url == "http://127.0.0.1:9" and engine.url == url
    finally:
        engine.close()


def test_vllm_without_the_worker_extension_says_which_flag(monkeypatch: Any) -> None:
    from rollpatch.engines.vllm import VllmEngine

    engine = VllmEngine("http://127.0.0.1:9")

    answers = [  # the worker's AttributeError: in the message, or (vLLM 0.32, as seen live)
        # in the 500's detail, quotes escaped
        EngineError("vLLM answered 500: 'CPUWorker' object has no attribute 'rollpatch_info'"),
        EngineError(
            "vLLM answered 500 to POST /collective_rpc",
            engine="vllm",
            detail='{"error":{"message":"Call to collective_rpc method failed: Worker failed '
            "with error \\'\\'CPUWorker\\' object has no attribute \\'rollpatch_info\\'\\', "
            'please check the stack trace above for the root cause"}}',
        ),
    ]
    try:
        for answer in answers:

            def post(path: str, body: Any = None, answer: Any = answer, **kw: Any) -> Any:
                # the first call is the adapter's claim (engines/ownership.py): named as sent
                method = body["method"]
                raise EngineError(
                    answer.message.replace("rollpatch_info", method),
                    **{
                        k: str(v).replace("rollpatch_info", method)
                        for k, v in answer.context.items()
                    },
                )

            monkeypatch.setattr(engine.http, "post", post)
            with pytest.raises(EngineError, match="lack rollpatch's extension") as e:
                engine.info()
            assert "--worker-extension-cls rollpatch.engines.vllm.WorkerExtension" in (
                e.value.hint or ""
            )
    finally:
        engine.close()
