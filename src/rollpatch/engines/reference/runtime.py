"""The reference runtime: a transformers causal LM on the CPU whose weights *are* a view.

:class:`ReferenceRuntime` loads a model with torch and builds a :class:`~rollpatch.view.View`
whose word arrays share memory with the model's parameters, so
``rollpatch.patch.apply(runtime.view, patch)`` changes the served weights with no reload and
no second copy. Generation (KV cache, greedy or top-p sampling, raw logprobs) checks a
pause gate before every forward pass; weight writes happen under :meth:`commit`, which holds
the forward lock, so no forward ever sees half-written weights.
"""

from __future__ import annotations

import inspect
import secrets
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, EngineError
from ...kinds import get_kind
from ...view import Tensor, View

__all__ = ["Generation", "ReferenceRuntime", "Step", "bind_view"]

#: torch dtype → (same-width integer dtype, unsigned numpy word dtype, rollpatch kind).
_WORDS: dict[torch.dtype, tuple[torch.dtype, type, str]] = {
    torch.bfloat16: (torch.int16, np.uint16, "bf16"),
    torch.float16: (torch.int16, np.uint16, "f16"),
    torch.float32: (torch.int32, np.uint32, "f32"),
}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_LOGPROBS = 20
#: Temperatures below this are greedy (as in vLLM): dividing by ~0 would overflow the logits.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class Step:
    """One generated token: its id, raw logprob and the top-k raw logprobs (id, logprob)."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


def _words_of(t: torch.Tensor, name: str) -> Tensor:
    spec = _WORDS.get(t.dtype)
    if spec is None:
        raise EngineError(
            "unsupported parameter dtype for an in-place view",
            tensor=name,
            dtype=str(t.dtype),
            hint="load the model as bfloat16/float16/float32",
        )
    if t.device.type != "cpu" or not t.is_contiguous():
        raise EngineError("parameter is not contiguous CPU memory", tensor=name)
    int_dtype, word_dtype, kind = spec
    data: np.ndarray = t.detach().view(int_dtype).numpy().view(word_dtype).reshape(-1)
    if data.size and data.__array_interface__["data"][0] != t.data_ptr():
        raise EngineError("view words do not alias the parameter", tensor=name)
    return Tensor(get_kind(kind), tuple(t.shape), data)


def bind_view(model: torch.nn.Module) -> View:
    """A view whose tensors share memory with ``model``'s persistent state, by checkpoint name.

    Non-persistent buffers (rotary tables) are not in ``state_dict`` and are skipped; a tied
    alias keeps only its first (checkpoint) name so no word is reachable under two names.
    Fused MoE expert parameters (transformers stacks them per layer) are exposed as the
    checkpoint's per-expert tensors, each a view of its contiguous slice (:mod:`.experts`).
    """
    from .experts import checkpoint_name, split_experts

    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        ptr = t.data_ptr()
        if ptr in seen and t.numel():
            continue
        seen.add(ptr)
        split = split_experts(model, name, t)
        if split is None:
            tensors[checkpoint_name(model, name)] = _words_of(t, name)
        else:
            tensors.update((n, _words_of(part, n)) for n, part in split)
    return View(tensors)


@dataclass
class _Progress:
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
        self, steps: Callable[[_Progress], Iterator[Step]], prompt_token_ids: list[int]
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self._progress = _Progress()
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


class ReferenceRuntime:
    """A CPU transformers model holding a served view in place. See the module docstring.

    ``version`` is set by the adapter (under :meth:`commit`); generations record it.
    ``step_hook``, when set, is called with the 0-based token index after each token, outside
    every lock (an instrumentation seam, used by the tests to pause mid-stream).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "bfloat16",
        threads: int | None = None,
        model_name: str | None = None,
        routed_experts: bool | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}", dtype=dtype)
        if threads is not None:
            if threads < 1:
                raise ConfigError("threads must be >= 1", threads=threads)
            torch.set_num_threads(threads)
        self.model_dir = Path(model_dir)
        self.model_name = model_name if model_name is not None else self.model_dir.name
        kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype]}
        if "disable_mmap" in inspect.signature(AutoModelForCausalLM.from_pretrained).parameters:
            kwargs["disable_mmap"] = True  # own the memory: never alias the file on disk
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, **kwargs)
        self.model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.model.config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = "logits_to_keep" in params
        self.view = bind_view(self.model)
        from .experts import RouterTap

        moe = bool(getattr(self.model.config, "num_experts_per_tok", 0))
        if routed_experts and not moe:
            raise ConfigError(
                "routed_experts needs a mixture-of-experts model",
                model_type=self.model.config.model_type,
            )
        #: Records each forward pass's routing (MoE models; ``routed_experts`` None = on).
        self.router: RouterTap | None = (
            RouterTap(self.model) if moe and routed_experts is not False else None
        )
        self.version: int | None = None
        self.step_hook: Callable[[int], None] | None = None
        self.tokens_generated = 0
        self._cond = threading.Condition()
        self._paused = False
        self._forwards = 0
        self._active = 0
        self._step_lock = threading.RLock()
        self._digest = self.view.digest()  # as of the last commit; for state() without locks

    # ---- weights -------------------------------------------------------------------------

    @contextmanager
    def commit(self) -> Iterator[View]:
        """Hold the forward lock: no forward pass runs while the caller writes the weights."""
        with self._step_lock:
            try:
                yield self.view
            finally:
                self._digest = self.view.digest()

    def digest(self) -> str:
        """Root digest of the in-place view, read between steps and commits (never mid-write).

        Per-tensor digests are cached; they stay valid because only commits write the words.
        """
        with self._step_lock:
            return self.view.digest()

    def load_view(self, view: View, version: int | None = None) -> None:
        """Copy a full view (keyframe) into the parameters; names, dtypes, shapes must match.

        Everything is checked before any word is written; the result is verified against
        ``view.digest()`` and only then is ``version`` recorded (under the forward lock). If
        verification fails, :class:`EngineError` is raised and ``version`` is left None.
        """
        mine = self.view
        if set(view) != set(mine):
            extra, missing = sorted(set(view) - set(mine)), sorted(set(mine) - set(view))
            raise EngineError(
                "keyframe tensor names differ from the model's",
                extra=extra[:5],
                missing=missing[:5],
            )
        for name, t in view.items():
            m = mine[name]
            if t.dtype != m.dtype or t.shape != m.shape:
                raise EngineError(
                    "keyframe tensor layout differs from the model's",
                    tensor=name,
                    dtype=t.dtype,
                    shape=t.shape,
                    expected_dtype=m.dtype,
                    expected_shape=m.shape,
                )
        want = view.digest()
        with self.commit():
            self.version = None
            for name, t in view.items():
                np.copyto(mine[name].data, t.data)
            mine.invalidate()
            if mine.digest() != want:
                raise EngineError("weights differ from the keyframe after copying")
            self.version = version

    # ---- pause gate ----------------------------------------------------------------------

    def pause(self, timeout: float | None = None) -> bool:
        """Hold new steps and wait for in-flight ones; False if ``timeout`` ran out.

        A step is one forward pass plus picking its token: once this returns True, no token
        is produced until :meth:`resume`. The gate stays closed even on a timeout.
        """
        with self._cond:
            self._paused = True
            return self._cond.wait_for(lambda: self._forwards == 0, timeout)

    def resume(self) -> None:
        """Release the gate; held generations continue."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def state(self) -> dict[str, Any]:
        """Version, digest (as of the last commit), pause flag and in-flight counts.

        Takes no lock that a forward pass holds, so the async admin routes never block.
        """
        with self._cond:
            paused, forwards, active = self._paused, self._forwards, self._active
        return {
            "version": self.version,
            "digest": self._digest,
            "paused": paused,
            "in_flight": active,
            "forwards_in_flight": forwards,
            "tokens_generated": self.tokens_generated,
            "model": self.model_name,
        }

    # ---- generation ----------------------------------------------------------------------

    def _step(
        self, ids: torch.Tensor, cache: Any, pick: Callable[[torch.Tensor], Step]
    ) -> tuple[Step, Any, int | None, np.ndarray | None]:
        """One token: pass the gate, forward under the lock, pick. Counts as in flight."""
        with self._cond:
            self._cond.wait_for(lambda: not self._paused)
            self._forwards += 1
        produced = False
        try:
            with self._step_lock, torch.inference_mode():
                kwargs: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
                if self._keep_arg:
                    kwargs["logits_to_keep"] = 1
                if self.router is not None:
                    self.router.start()
                out = self.model(input_ids=ids, **kwargs)
                version = self.version
                routes = self.router.take() if self.router is not None else None
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            step = pick(out.logits[0, -1].float())
            produced = True
            return step, cache, version, routes
        finally:
            with self._cond:
                self._forwards -= 1
                self.tokens_generated += produced
                self._cond.notify_all()

    def check(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        logprobs: int | None,
    ) -> None:
        """Validate generation arguments; raises :class:`ConfigError` naming the field."""
        if not prompt_token_ids:
            raise ConfigError("prompt must not be empty", field="prompt")
        if any(not 0 <= int(t) < self.vocab_size for t in prompt_token_ids):
            raise ConfigError(
                "prompt token id out of range", field="prompt", vocab_size=self.vocab_size
            )
        if max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1", field="max_tokens")
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise ConfigError(
                "prompt plus max_tokens exceeds the context length",
                field="max_tokens",
                max_model_len=self.max_model_len,
                prompt_tokens=len(prompt_token_ids),
            )
        if not temperature >= 0:
            raise ConfigError("temperature must be >= 0", field="temperature")
        if not 0 < top_p <= 1:
            raise ConfigError("top_p must be in (0, 1]", field="top_p")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {MAX_LOGPROBS}]", field="logprobs")

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: int | None = None,
        stop: Collection[int] | None = None,
        ignore_eos: bool = False,
    ) -> Generation:
        """Generate up to ``max_tokens`` tokens after ``prompt_token_ids``.

        Greedy (deterministic) when ``temperature`` is 0 (below ``GREEDY_BELOW``); else
        temperature + top-p sampling seeded by ``seed``. ``logprobs`` (None = off) reports the
        raw model logprob of each token and the top ``logprobs`` alternatives. ``stop`` holds
        stop token ids (EOS is added unless ``ignore_eos``); stop *strings* are the server's
        job. Arguments are validated before this returns; tokens are produced lazily.
        """
        prompt = [int(t) for t in prompt_token_ids]
        self.check(prompt, max_tokens, temperature, top_p, logprobs)
        stops = set(stop or ()) | (set() if ignore_eos else set(self.eos_token_ids))
        gen = None if temperature < GREEDY_BELOW else torch.Generator()
        if gen is not None:
            gen.manual_seed(seed % (1 << 64) if seed is not None else secrets.randbits(63))

        def pick(logits: torch.Tensor) -> Step:
            return _pick(logits, temperature, top_p, gen, logprobs)

        def steps(g: _Progress) -> Iterator[Step]:
            with self._cond:
                self._active += 1
            try:
                ids, cache = torch.tensor([prompt], dtype=torch.long), None
                for i in range(max_tokens):
                    step, cache, version, routes = self._step(ids, cache, pick)
                    if i == 0:
                        g.version_start = version
                    g.version_end = version
                    if routes is not None:
                        g.routes.append(routes)
                        g.route_versions.append((len(routes), version))
                    if self.step_hook is not None:
                        self.step_hook(i)
                    done = step.token_id in stops
                    g.finish_reason = "stop" if done else "length"
                    yield step
                    if done:
                        return
                    ids = torch.tensor([[step.token_id]], dtype=torch.long)
            finally:
                with self._cond:
                    self._active -= 1

        return Generation(steps, prompt)


def _pick(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    gen: torch.Generator | None,
    k: int | None,
) -> Step:
    """Choose the next token; logprobs are of the raw (unscaled, unfiltered) distribution."""
    if gen is None:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = (torch.cumsum(sorted_p, 0) - sorted_p) < top_p
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
