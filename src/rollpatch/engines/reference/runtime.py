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
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, EngineError, IncompatibleModelError
from ...view import View
from .binding import Storage, bind_params, bind_view, rebind, storage_for
from .generation import GREEDY_BELOW, MAX_LOGPROBS, Generation, Progress, Step, pick_token

__all__ = ["Generation", "ReferenceRuntime", "Step", "bind_view"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
        self._params = bind_params(self.model)  # whole-parameter tensors (double buffers)
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
    def commit(self, *, root: str | None = None) -> Iterator[View]:
        """Hold the forward lock: no forward pass runs while the caller writes the weights.

        ``root``: the root digest the view holds if the block returns (a staged commit's
        proven target), recorded as is; else (and on any failure) it is recomputed from the
        view's cached digests."""
        with self._step_lock:
            ok = False
            try:
                yield self.view
                ok = True
            finally:
                self._digest = root if ok and root is not None else self.view.digest()

    @property
    def held_digest(self) -> str:
        """The root digest as of the last commit (no lock, no hashing: every write to the
        weights goes through :meth:`commit`, which records it)."""
        return self._digest

    def storage(self, buffers: dict[str, np.ndarray]) -> dict[str, Storage]:
        """Each buffer made ready to become its tensor's parameter storage (before a pause:
        the conversions and checks :meth:`exchange` would otherwise do under it). Only whole
        parameters (not fused MoE experts): :class:`EngineError` otherwise."""
        self._whole(buffers)
        return {n: storage_for(self._params[n], words, n) for n, words in buffers.items()}

    def _whole(self, buffers: Collection[str]) -> None:
        missing = sorted(set(buffers) - set(self._params))
        if missing:
            raise EngineError(
                "double-buffered commits need whole parameters",
                tensor=missing[0],
                hint="fused MoE experts are slices of one parameter: use writes='in_place'",
            )

    def exchange(self, buffers: Mapping[str, np.ndarray | Storage]) -> dict[str, Any]:
        """Put each buffer (best made ready by :meth:`storage` before the pause: then two
        assignments each) in place of its tensor's parameter storage, O(1) each; the caller
        holds :meth:`commit`. All or nothing: on failure the previous storage is put back.
        Only whole parameters (not fused MoE experts): :class:`EngineError` otherwise.
        Returns the storage replaced (release it outside the pause: freeing takes time)."""
        self._whole(buffers)
        held: dict[str, tuple[Any, Any]] = {}
        try:
            for name, words in buffers.items():
                p = self._params[name]
                held[name] = (p.data, self.view[name])
                self.view[name] = rebind(p, words, name)
        except BaseException:
            for name, (data, tensor) in held.items():
                self._params[name].data = data
                self.view[name] = tensor
            raise
        return held

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
            raise IncompatibleModelError(
                "keyframe tensor names differ from the model's",
                extra=extra[:5],
                missing=missing[:5],
            )
        for name, t in view.items():
            m = mine[name]
            if t.dtype != m.dtype or t.shape != m.shape:
                raise IncompatibleModelError(
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

    def _enter_step(self) -> None:
        """Pass the gate and take the forward lock, counted in flight. A step that waited for
        the lock while a pause closed the gate goes back to the gate without running: a pause
        waits for the pass that holds the lock, not for the next pass of every stream queued
        behind it (with 4 streams, 4 passes: 110-120 ms of pause at 103M under load)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._paused)
            self._step_lock.acquire()
            try:
                with self._cond:
                    if not self._paused:
                        self._forwards += 1
                        return
            except BaseException:  # e.g. an interrupt while taking the condition: no leak
                self._step_lock.release()
                raise
            self._step_lock.release()

    def _step(
        self, ids: torch.Tensor, cache: Any, pick: Callable[[torch.Tensor], Step]
    ) -> tuple[Step, Any, int | None, np.ndarray | None]:
        """One token: pass the gate, forward under the lock, pick. Counts as in flight."""
        self._enter_step()
        produced = False
        try:
            try:
                with torch.inference_mode():
                    kwargs: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
                    if self._keep_arg:
                        kwargs["logits_to_keep"] = 1
                    if self.router is not None:
                        self.router.start()
                    out = self.model(input_ids=ids, **kwargs)
                    version = self.version
                    routes = self.router.take() if self.router is not None else None
            finally:
                self._step_lock.release()
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            step = pick(out.logits[0, -1].float())
            produced = True
            return step, cache, version, routes
        finally:
            with self._cond:
                self._forwards -= 1
                self.tokens_generated += produced
                self._cond.notify_all()

    def next_logits(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, int | None]:
        """The float32 logits (shape ``[vocab]``) of the token after ``token_ids`` under the
        held version, and that version (None before the first commit).

        One forward pass over ``token_ids`` without a cache, as a generation's first step: it
        waits at the pause gate, runs under the forward lock (so no commit lands mid-pass and
        the version returned is the one whose weights made the logits) and counts in
        ``state()`` as a step. Invalid ids raise :class:`ConfigError`.
        """
        ids = [int(t) for t in token_ids]
        self.check(ids, 1, 1.0, 1.0, 0)
        kept: list[torch.Tensor] = []

        def keep(logits: torch.Tensor) -> Step:
            kept.append(logits)
            return Step(0, None, None)

        _, _, version, _ = self._step(torch.tensor([ids], dtype=torch.long), None, keep)
        return kept[0], version

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
            return pick_token(logits, temperature, top_p, gen, logprobs)

        def steps(g: Progress) -> Iterator[Step]:
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
