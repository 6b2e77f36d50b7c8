"""The soak's load (concurrent ``openai`` clients through the gateway) and the after-run check
of every answer against a reference model holding the version it was labelled with."""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _soak_procs import MAX_TOKENS, PROMPT, base_masters, masters_for

#: How old a sidecar's LATEST may be (``SidecarConfig.latest_max_age_s``; past it, max_lag
#: requests are refused): an answer is checked against LATEST as it was this long before the
#: request was sent.
STALE_S = 5.0
WAIT_S = 5.0


@dataclass
class Result:
    sent: float
    done: float
    status: int  # 0: no HTTP answer (connection error, timeout)
    start: int | None = None
    end: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str = ""


class Load:
    """``clients`` concurrent requests in flight through the gateway, until :meth:`stop`.

    ``rate`` (requests per second, all clients together; None: a closed loop, each client
    sending again as soon as it is answered): a closed loop takes whatever CPU the machine
    has, so its cost in CI grows with the other jobs' load; paced, the fleet's work is bounded
    by the request count while the clients still overlap every commit.
    """

    def __init__(
        self, url: str, clients: int, lag: int, model: str, *, rate: float | None = None
    ) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        self.url, self.clients, self.lag, self.model = url, clients, lag, model
        self.rate = rate
        self._next_send = 0.0  # paced: when the next request may go (one event loop: no lock)
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), daemon=True, name="soak-load"
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def count(self, t0: float, t1: float, status: int) -> int:
        return sum(1 for r in list(self.results) if t0 <= r.sent <= t1 and r.status == status)

    async def _main(self) -> None:
        import openai

        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="soak", max_retries=0, timeout=60
        )
        await asyncio.gather(*(self._client(client) for _ in range(self.clients)))
        await client.close()

    async def _pace(self) -> None:
        """With ``rate``: wait for this client's turn (sends spaced 1/rate s apart)."""
        if self.rate is None:
            return
        now = time.monotonic()
        at = max(now, self._next_send)
        self._next_send = at + 1.0 / self.rate
        if at > now:
            await asyncio.sleep(at - now)

    async def _client(self, client: Any) -> None:
        import openai

        while not self._stop.is_set():
            await self._pace()
            if self._stop.is_set():
                break
            sent = time.monotonic()
            try:
                raw = await client.completions.with_raw_response.create(
                    model=self.model,
                    prompt=PROMPT,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    logprobs=1,
                    extra_body={
                        "return_token_ids": True,
                        "rollpatch": {"max_lag": self.lag, "wait_s": WAIT_S},
                    },
                )
                body = raw.parse().model_dump()
                rp, choice = body.get("rollpatch") or {}, body["choices"][0]
                self.results.append(
                    Result(
                        sent,
                        time.monotonic(),
                        200,
                        rp.get("version_start"),
                        rp.get("version_end"),
                        list(choice.get("token_ids") or []),
                        list((choice.get("logprobs") or {}).get("token_logprobs") or []),
                    )
                )
            except openai.APIStatusError as e:
                self.results.append(
                    Result(sent, time.monotonic(), e.status_code, error=str(e)[:200])
                )
                await asyncio.sleep(0.2)  # what Retry-After asks, roughly
            except (openai.APIConnectionError, openai.APITimeoutError) as e:
                self.results.append(Result(sent, time.monotonic(), 0, error=str(e)[:200]))
                await asyncio.sleep(0.2)


def verify(
    results: list[Result], latest_log: list[tuple[float, int]], model: Path, lag: int
) -> dict[str, Any]:
    """Count answers by kind; re-generate every labelled version with the reference model."""
    from rollpatch.engines.reference import ReferenceRuntime
    from rollpatch.formats import cast_view

    times = [t for t, _ in latest_log]
    statuses: dict[int, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    served = [r for r in results if r.status == 200]
    wrong, unacceptable, spanning = 0, 0, 0
    examples: list[str] = []
    t_first = min((r.sent for r in results), default=0.0)
    oracle = ReferenceRuntime(model, threads=1)
    base = base_masters(model)
    prompt = oracle.tokenizer(PROMPT)["input_ids"]
    expected: dict[int, tuple[list[int], np.ndarray]] = {}
    for r in served:
        if r.start is None or r.end is None or r.end < r.start:
            wrong += 1
            examples.append(f"unlabelled answer at {r.sent - t_first:.1f} s: {r.start}..{r.end}")
            continue
        if r.start != r.end:  # a commit landed mid-generation (a drain past its deadline):
            spanning += 1  # labelled honestly, but no single version can re-generate it
            continue
        if r.start not in expected:
            oracle.load_view(cast_view(masters_for(base, r.start), "bf16"))
            steps = list(oracle.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1))
            expected[r.start] = (
                [s.token_id for s in steps],
                np.array([s.logprob for s in steps], np.float32),
            )
        tokens, logprobs = expected[r.start]
        if r.tokens != tokens or not np.array_equal(np.array(r.logprobs, np.float32), logprobs):
            wrong += 1
            examples.append(f"wrong version at {r.sent - t_first:.1f} s: labelled {r.start}")
        i = bisect.bisect_right(times, r.sent - STALE_S) - 1
        if i >= 0 and r.start < latest_log[i][1] - lag:
            unacceptable += 1
            examples.append(
                f"unacceptable at {r.sent - t_first:.1f} s (answered after "
                f"{r.done - r.sent:.1f} s): version {r.start}, LATEST was "
                f"{latest_log[i][1]} {STALE_S:g} s before it was sent"
            )
    lat = sorted(1000 * (r.done - r.sent) for r in served) or [0.0]
    return {
        "requests": len(results),
        "served": len(served),
        "refused": sum(statuses.get(s, 0) for s in (409, 502, 503)),
        "other": sum(n for s, n in statuses.items() if s not in (0, 200, 409, 502, 503)),
        "client_errors": statuses.get(0, 0),
        "statuses": statuses,
        "wrong_version": wrong,
        "unacceptable": unacceptable,
        "versions_checked": len(expected),
        "spanning": spanning,
        "examples": examples[:12],
        "p50_ms": lat[len(lat) // 2],
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
    }
