"""The reference engine's OpenAI-compatible server: completions and chat through the real
``openai`` client, streaming (SSE) under concurrency and disconnects, errors as JSON.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.conftest import until
from tests.refenginefix import PROMPT, client, engine, greedy, model_dir

_FIXTURES = (client, engine, model_dir)  # used by name


# ---- OpenAI-compatible server -------------------------------------------------------------


def test_completions_with_openai_client(engine: Any, client: Any) -> None:
    rt, want = engine.runtime, greedy(engine.runtime, 12)
    r = client.completions.create(
        model=rt.model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    c, extra = r.choices[0], r.choices[0].model_extra
    assert extra["token_ids"] == [t for t, _, _ in want]
    assert extra["prompt_token_ids"] == rt.tokenizer.encode(PROMPT)
    assert c.logprobs.token_logprobs == [lp for _, lp, _ in want]
    assert len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) == r.usage.completion_tokens
    assert c.logprobs.text_offset[0] == 0 and c.finish_reason == "length"
    assert all(len(t) <= 3 for t in c.logprobs.top_logprobs)  # 3 unless two pieces decode alike
    assert r.model_extra["rollpatch"] == {"version_start": 1, "version_end": 1}
    assert (
        client.completions.create(
            model=rt.model_name,
            prompt=extra["prompt_token_ids"],
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        == c.text
    )
    chunks = list(
        client.completions.create(
            model=rt.model_name,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    ids = [i for ch in chunks if ch.choices for i in ch.choices[0].model_extra.get("token_ids", [])]
    assert ids == extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].model_extra["rollpatch"] == {"version_start": 1, "version_end": 1}

    text = c.text
    stop = next(ch for ch in text[len(text) // 2 :] if not ch.isspace())
    for stream in (False, True):
        s = client.completions.create(
            model=rt.model_name,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        parts = list(s) if stream else [s]
        assert "".join(p.choices[0].text for p in parts) == text[: text.find(stop)]
        assert parts[-1].choices[0].finish_reason == "stop"


def test_concurrency_disconnects_and_sse_format(engine: Any) -> None:
    url, rt = engine.url, engine.runtime
    want = [t for t, _, _ in greedy(rt, 20)]

    def one(n: int) -> list[int]:
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={
                "prompt": PROMPT,
                "max_tokens": 14 + 2 * n,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        return list(r.json()["choices"][0]["token_ids"])

    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(one, range(4)))
    assert all(out[n] == want[: 14 + 2 * n] for n in range(4))  # interleaving changes nothing
    body = {
        "prompt": PROMPT,
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up mid-stream
    deadline = time.monotonic() + 10
    while rt.state()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.state()["in_flight"] == 0  # the abandoned generation stopped
    # and one not streamed: it ran to its end before (an audit's MEDIUM finding, session 39)
    body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    made = rt.state()["tokens_generated"]
    with pytest.raises(httpx.ReadTimeout):  # ~9 s of generation here; it hangs up at 1 s
        httpx.post(url + "/v1/completions", json=body, timeout=1.0)
    until(lambda: rt.state()["in_flight"] == 0, "the abandoned generation to end")
    assert rt.state()["tokens_generated"] - made < 4000  # cut short, not run to its end
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:  # SSE format
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "length" and "rollpatch" in last


def test_chat_with_openai_client(engine: Any, client: Any) -> None:
    rt = engine.runtime
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(
        model=rt.model_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    c = r.choices[0]
    assert len(c.logprobs.content) == 10 and all(
        len(e.top_logprobs) == 2 for e in c.logprobs.content
    )
    assert c.logprobs.content[0].logprob == c.logprobs.content[0].top_logprobs[0].logprob
    assert len(c.model_extra["token_ids"]) == 10 and r.model_extra["prompt_token_ids"]
    assert r.model_extra["rollpatch"] == {"version_start": 1, "version_end": 1}
    assert c.message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=rt.model_name,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert chunks[-1].model_extra["rollpatch"]["version_end"] == 1
    sampled = [
        client.chat.completions.create(
            model=rt.model_name,
            messages=messages,
            max_tokens=8,
            temperature=0.9,
            top_p=0.9,
            seed=11,
            extra_body={"return_token_ids": True},
        )
        .choices[0]
        .model_extra["token_ids"]
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "echo": True}, "echo"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [5, 99_999]}, "prompt"),
        ({"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_bad_completion_requests_are_400(engine: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(engine.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_other_errors_are_json(engine: Any, client: Any) -> None:
    url = engine.url
    r = httpx.post(
        url + "/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400
    r = httpx.get(url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.NotFoundError, match="This engine serves `") as e:
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    assert "GET /v1/models" in str(e.value)  # what to send instead
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=engine.runtime.model_name,
            max_tokens=2,
            n=3,
            messages=[{"role": "user", "content": "x"}],
        )
    assert [m.id for m in client.models.list().data] == [engine.runtime.model_name]
