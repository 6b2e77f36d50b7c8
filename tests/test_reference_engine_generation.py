"""The reference engine's generation: pause holds it (a commit while paused changes the
version mid-stream), resume continues it, and the logits of the next token under the held
version (``ReferenceRuntime.next_logits``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from rollpatch.errors import ConfigError
from rollpatch.patch import diff
from rollpatch.view import View
from tests.refenginefix import PROMPT, base, client, engine, model_dir, restore, target

_FIXTURES = (base, client, engine, model_dir, restore, target)  # used by name


# ---- pause, resume, commit mid-generation ---------------------------------------------


def test_pause_holds_generation_and_commit_changes_version(
    engine: Any, client: Any, base: View, target: View, restore: None
) -> None:
    rt, url = engine.runtime, engine.url
    reached, go = threading.Event(), threading.Event()

    def hook(i: int) -> None:
        if i == 3:
            reached.set()
            go.wait(10)

    rt.step_hook = hook
    chunks: list[Any] = []
    worker = threading.Thread(
        target=lambda: chunks.extend(
            client.completions.create(
                model=rt.model_name,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        )
    )
    worker.start()
    assert reached.wait(30)
    state = httpx.post(url + "/rollpatch/pause", timeout=30).json()
    assert state["paused"] is True and state["forwards_in_flight"] == 0
    go.set()
    held = rt.tokens_generated
    time.sleep(0.3)
    state = httpx.get(url + "/rollpatch/state", timeout=30).json()
    assert rt.tokens_generated == held and state["in_flight"] == 1 and worker.is_alive()
    engine.apply(diff(base, target), 2)  # commit while paused
    assert httpx.get(url + "/rollpatch/state", timeout=30).json()["version"] == 2
    httpx.post(url + "/rollpatch/resume", timeout=30)
    worker.join(30)
    assert len([i for ch in chunks for i in ch.choices[0].model_extra.get("token_ids", [])]) == 12
    assert chunks[-1].model_extra["rollpatch"] == {"version_start": 1, "version_end": 2}


def test_pause_drains_and_resume_continues(engine: Any) -> None:
    rt = engine.runtime
    started = threading.Event()
    rt.step_hook = lambda i: started.set()
    out: list[Any] = []
    ids = rt.tokenizer.encode(PROMPT)
    worker = threading.Thread(
        target=lambda: out.extend(rt.generate(ids, max_tokens=300, temperature=0, ignore_eos=True))
    )
    try:
        worker.start()
        assert started.wait(30)
        assert rt.pause(timeout=30)
        held = rt.tokens_generated
        time.sleep(0.2)
        assert rt.tokens_generated == held and rt.state()["forwards_in_flight"] == 0
    finally:
        rt.resume()
        rt.step_hook = None
    worker.join(60)
    assert len(out) == 300


class _CountingLock:
    """The runtime's forward lock, counting the threads waiting to take it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.waiting, self.cond = inner, 0, threading.Condition()

    def acquire(self) -> bool:
        with self.cond:
            self.waiting += 1
            self.cond.notify_all()
        try:
            return bool(self.inner.acquire())
        finally:
            with self.cond:
                self.waiting -= 1

    def release(self) -> None:
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_pause_waits_for_the_pass_running_not_for_the_queued_ones(engine: Any) -> None:
    """Streams interleave one forward pass at a time. A pause must wait for the pass that
    holds the forward lock only: the passes queued behind it go back to the gate (before,
    each counted as in flight and ran first, so a pause under 4 streams took 4 passes)."""
    rt = engine.runtime
    model, lock = rt.model, _CountingLock(rt._step_lock)
    in_pass, release, calls = threading.Event(), threading.Event(), [0]

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the first pass holds the lock until the test lets it go
            in_pass.set()
            release.wait(30)
        return model(*args, **kwargs)

    ids = rt.tokenizer.encode(PROMPT)
    outs: list[list[Any]] = [[] for _ in range(3)]
    workers = [
        threading.Thread(
            target=lambda o=o: o.extend(
                rt.generate(ids, max_tokens=2, temperature=0, ignore_eos=True)
            )
        )
        for o in outs
    ]
    rt.model, rt._step_lock = slow, lock
    paused: list[bool] = []
    pauser = threading.Thread(target=lambda: paused.append(rt.pause(timeout=30)))
    try:
        before = rt.tokens_generated
        workers[0].start()
        assert in_pass.wait(30)
        for w in workers[1:]:
            w.start()
        with lock.cond:  # both queued behind the pass in progress
            assert lock.cond.wait_for(lambda: lock.waiting == 2, 30)
        pauser.start()
        time.sleep(0.2)
        assert not paused  # the pass in progress is still running
        release.set()
        pauser.join(30)
        assert paused == [True]
        assert rt.tokens_generated - before == 1  # the queued passes did not run
        time.sleep(0.2)
        assert rt.tokens_generated - before == 1 and rt.state()["forwards_in_flight"] == 0
    finally:
        release.set()
        rt.resume()
        for w in workers:
            if w.is_alive() or w.ident is not None:
                w.join(60)
        rt.model, rt._step_lock = model, lock.inner
    assert [len(o) for o in outs] == [2, 2, 2]


# ---- the logits of the next token (the demo's label check) ----------------------------


def test_next_logits_are_what_generate_samples_from(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """``next_logits`` gives the logits a generation's first step picks from, bit for bit,
    under the held version, and names that version; a commit changes both."""
    from rollpatch.engines.reference.generation import pick_token

    rt = engine.runtime
    ids = rt.tokenizer.encode(PROMPT)
    for version in (1, 2):
        logits, held = rt.next_logits(ids)
        assert held == version == engine.version
        assert logits.dtype == torch.float32 and tuple(logits.shape) == (rt.vocab_size,)
        for seed in (0, 7):  # sampled as generate samples: same token, logprob and top-3
            gen = torch.Generator()
            gen.manual_seed(seed)
            want = next(rt.generate(ids, max_tokens=1, temperature=1.0, seed=seed, logprobs=3))
            assert pick_token(logits, 1.0, 1.0, gen, 3) == want
        greedy_first = next(rt.generate(ids, max_tokens=1, temperature=0, logprobs=3))
        assert pick_token(logits, 0.0, 1.0, None, 3) == greedy_first
        if version == 1:
            before = logits
            engine.apply(diff(base, target), 2)
    assert not torch.equal(before, logits)  # the committed weights made the second


def test_non_finite_logits_are_an_engine_error_not_a_token() -> None:
    """Weights holding NaN (a version published with nonfinite='allow') gave token 0 greedy
    and a sampler RuntimeError (a bare 500) otherwise; now an EngineError saying why. A -inf
    logit alone is a token that cannot be drawn."""
    from rollpatch.engines.reference.generation import pick_token
    from rollpatch.errors import EngineError

    ok = torch.tensor([0.0, -float("inf"), 1.0])
    assert pick_token(ok, 0.0, 1.0, None, 1).token_id == 2
    for bad in ([0.0, float("nan"), 1.0], [0.0, float("inf")], [-float("inf")] * 3):
        for gen in (None, torch.Generator()):
            with pytest.raises(EngineError, match="logits hold NaN or infinite values"):
                pick_token(torch.tensor(bad), 1.0, 1.0, gen, 1)


def test_next_logits_waits_at_the_pause_gate(
    engine: Any, base: View, target: View, restore: None
) -> None:
    """Paused, ``next_logits`` waits; a version committed meanwhile is the one it reads."""
    rt = engine.runtime
    ids = rt.tokenizer.encode(PROMPT)
    out: list[Any] = []
    assert rt.pause(timeout=30)
    worker = threading.Thread(target=lambda: out.append(rt.next_logits(ids)))
    try:
        worker.start()
        time.sleep(0.2)
        assert worker.is_alive() and not out  # held at the gate, no forward ran
        engine.apply(diff(base, target), 2)
    finally:
        rt.resume()
    worker.join(30)
    assert not worker.is_alive() and out[0][1] == 2


@pytest.mark.parametrize(
    ("ids", "field"),
    [([], "prompt"), ([-1], "prompt"), ([2048], "prompt"), ([1] * 4096, "max_tokens")],
)
def test_next_logits_refuses_bad_ids(engine: Any, ids: list[int], field: str) -> None:
    """Empty, out-of-vocabulary (2048 ids) or too long for one more token (4096 positions):
    a ConfigError naming the field, and no forward pass run."""
    rt = engine.runtime
    steps = rt.tokens_generated
    with pytest.raises(ConfigError) as e:
        rt.next_logits(ids)
    assert e.value.context["field"] == field
    assert rt.tokens_generated == steps


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46, 1e-7])
def test_a_top_p_below_float32s_range_samples_the_likeliest_token(top_p: float) -> None:
    """A top_p the request's check lets through but float32 rounds to 0 keeps the likeliest
    token (it asked for nucleus sampling over almost nothing), instead of keeping none and
    failing in ``torch.multinomial`` ("sum of probabilities <= 0", found by schemathesis)."""
    from rollpatch.engines.reference.generation import pick_token

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9], dtype=torch.float32)
    for seed in range(5):
        gen = torch.Generator()
        gen.manual_seed(seed)
        assert pick_token(logits, 1.0, top_p, gen, None).token_id == 1
