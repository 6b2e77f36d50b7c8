"""What a generation yields and records: :class:`Step` (a token and its raw logprobs),
:class:`Generation` (the iterator, with the weight versions it ran under and MoE routing), and
the token choice (greedy, or temperature + top-p sampling)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import EngineError

__all__ = ["GREEDY_BELOW", "MAX_LOGPROBS", "Generation", "Progress", "Step", "pick_token"]

MAX_LOGPROBS = 20
#: Temperatures below this are greedy (as in vLLM): dividing by ~0 would overflow the logits.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class Step:
    """One generated token: its id, raw logprob and the top-k raw logprobs (id, logprob)."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class Progress:
    """What a generation has recorded so far (kept apart from the iterator: no cycle)."""

    version_start: int | None = None
    version_end: int | None = None
    finish_reason: str | None = None
    #: MoE only: each forward pass's routing ``[tokens, layers, top_k]`` and (rows, version).
    routes: list[np.ndarray] = field(default_factory=list)
    route_versions: list[tuple[int, int | None]] = field(default_factory=list)


class Generation:
    """An iterator of :class:`Step` that records the weight versions it was produced under.

    ``version_start``/``version_end`` are the runtime versions read (under the forward lock)
    at the forward passes that produced the first and the last token; ``finish_reason`` is
    ``"stop"`` or ``"length"`` once exhausted. Dropping or closing it frees its KV cache.
    """

    def __init__(
        self, steps: Callable[[Progress], Iterator[Step]], prompt_token_ids: list[int]
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self._progress = Progress()
        self._it = steps(self._progress)

    @property
    def version_start(self) -> int | None:
        return self._progress.version_start

    @property
    def version_end(self) -> int | None:
        return self._progress.version_end

    @property
    def finish_reason(self) -> str | None:
        return self._progress.finish_reason

    def routed_experts(self, prompt_start: int = 0) -> np.ndarray | None:
        """The experts every forward pass routed each token to, as vLLM returns them:
        ``[prompt + generated - 1 - prompt_start, layers, top_k]`` (the last token was never
        forwarded), skipping the first ``prompt_start`` prompt tokens. None unless MoE."""
        g = self._progress
        if not g.routes:
            return None
        return np.concatenate(g.routes, axis=0)[prompt_start:]

    def routed_spans(self, prompt_start: int = 0) -> list[dict[str, int | None]]:
        """Row spans of :meth:`routed_experts` with the weight version that routed them:
        ``[{start, end, version}]`` (one span unless a commit landed mid-generation)."""
        from .experts import spans

        out = []
        for sp in spans(self._progress.route_versions):
            start, end = (
                max(0, int(sp["start"] or 0) - prompt_start),
                int(sp["end"] or 0) - prompt_start,
            )
            if end > start:
                out.append({"start": start, "end": end, "version": sp["version"]})
        return out

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        return next(self._it)

    def close(self) -> None:
        """Stop generating early (frees the KV cache and the in-flight slot)."""
        self._it.close()  # type: ignore[attr-defined]


def pick_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    gen: torch.Generator | None,
    k: int | None,
) -> Step:
    """Choose the next token; logprobs are of the raw (unscaled, unfiltered) distribution.
    Logits with a NaN or +inf, or only -inf (weights that hold such values: a version
    published with ``PublisherConfig(nonfinite="allow")``) are an :class:`EngineError`
    saying so, not a token 0 or a sampler's RuntimeError (a -inf logit alone is a token
    that cannot be drawn)."""
    if bool(
        torch.isnan(logits).any() | torch.isposinf(logits).any() | torch.isneginf(logits).all()
    ):
        raise EngineError(
            "the model's logits hold NaN or infinite values: its weights do",
            hint="publish finite weights (the publisher refuses NaN and inf by default: "
            "PublisherConfig(nonfinite='refuse'))",
        )
    if gen is None:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = (torch.cumsum(sorted_p, 0) - sorted_p) < top_p
            # the likeliest token always stays: a top_p below float32's least subnormal
            # (1e-300 passes the request's check) rounds to 0 in the compare and kept none
            keep[0] = True
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        token = int(torch.multinomial(probs, 1, generator=gen))
    if k is None:
        return Step(token, None, None)
    lp = torch.log_softmax(logits, dim=-1)
    top: list[tuple[int, float]] = []
    if k:
        values, idx = torch.topk(lp, k)
        top = [(int(i), float(v)) for i, v in zip(idx, values)]
    return Step(token, float(lp[token]), top)
