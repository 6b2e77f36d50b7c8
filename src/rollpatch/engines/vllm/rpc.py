"""The vLLM adapter's calls into the workers and the server (sidecar side; no torch, no vLLM).

:class:`WorkerCalls` is the half of :class:`~.adapter.VllmEngine` that talks to the server:
``/collective_rpc`` to every worker (all ranks must succeed and agree; worker errors come
back as rollpatch exceptions), the official weight-update transport, scratch files in the
directory shared with the server, the nested ``/pause`` and ``/resume``, and the timing of
each call (``last_timings``: the pause breakdown that bench/vllm.py prints).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import EngineError, RollpatchError, engine_error
from ...io.safetensors import load_view
from ...view import Tensor
from ..ownership import owner_token
from ..pausing import NestedPause
from ..shared_dir import SharedDir
from ..staged import EncodedStep
from . import nudge
from .client import Http

__all__ = ["NOT_READY", "RemoteWords", "WorkerCalls", "worker_error"]

#: The ``weight_version`` tag of an engine that holds no verified version.
NOT_READY = "rollpatch:not-ready"


class WorkerCalls(NestedPause):
    """Calls into one vLLM server's workers (see the module docstring); ``url``,
    ``shared_dir`` (default: a private temporary directory, so the server must run on this
    host) and ``timeout`` (seconds per HTTP call) as :class:`~.adapter.VllmEngine` takes them."""

    name = "vllm"

    def __init__(
        self, url: str, shared_dir: str | Path | None, timeout: float, token: str | None = None
    ) -> None:
        every = nudge.period_s()  # ROLLPATCH_VLLM_NUDGE_MS (None: off)
        self.http = (
            Http(url, timeout, nudge=nudge.PATH, nudge_s=every, token=token)
            if every
            else Http(url, timeout, token=token)
        )
        self.scratch = SharedDir(shared_dir, prefix="rollpatch-vllm-")
        super().__init__(threading.RLock())
        self.last_timings: dict[str, float] = {}
        #: Rank 0's worker state identity (``RuntimeWeights.boot``) in the last answer.
        self.last_boot: str | None = None
        #: This adapter's token in every worker call: one sidecar per engine
        #: (:mod:`rollpatch.engines.ownership`); claimed at the first call, and again at the
        #: first after another adapter took the engine over (``displaced``, also after
        #: :meth:`release`: then what this one verified is void, and the engine's tag is the
        #: other one's).
        self.owner = owner_token()
        self._claimed = False
        self.displaced = False

    @property
    def shared_dir(self) -> Path:
        """The directory shared with the server (:attr:`scratch`'s)."""
        return self.scratch.path

    def _rpc(self, method: str, *args: str) -> list[Any]:
        if not self._claimed:
            self._claim()
        return self._post_rpc(method, list(args), {"owner": self.owner})

    def claim(self) -> None:
        """:meth:`EngineAdapter.claim`: the workers' claim, once."""
        if not self._claimed:
            self._claim()

    def _claim(self) -> None:
        """Make this adapter the engine's owner (refused while another one calls it)."""
        self._gather(self._post_rpc("rollpatch_claim", [self.owner], {}))
        self._claimed = True

    def _post_rpc(self, method: str, args: list[str], kwargs: dict[str, str]) -> list[Any]:
        body = {"method": method, "args": args, "kwargs": kwargs, "timeout": self.http.timeout}
        try:
            out = self.http.post("/collective_rpc", body)
        except EngineError as e:
            # vLLM's 500 carries the worker's AttributeError in its detail (quotes escaped)
            text = " ".join([e.message, *map(str, e.context.values())])
            if "has no attribute" not in text or method not in text:
                raise
            raise EngineError(  # vLLM runs without rollpatch's methods in its workers
                "vLLM's workers lack rollpatch's extension",
                engine=self.name,
                method=method,
                hint="start vLLM with --worker-extension-cls "
                "rollpatch.engines.vllm.WorkerExtension (docs/vllm.md)",
            ) from None
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineError(
                "collective_rpc returned no results",
                engine=self.name,
                method=method,
                hint="start vLLM with VLLM_SERVER_DEV_MODE=1 and "
                "--worker-extension-cls rollpatch.engines.vllm.WorkerExtension",
            )
        return results

    def _call(self, op: str, *args: str) -> dict[str, Any]:
        return self._gather(self._rpc(f"rollpatch_{op}", *args))

    def _gather(self, results: list[Any]) -> dict[str, Any]:
        """All ranks must succeed and agree; returns rank 0's result."""
        for r in results:
            if not isinstance(r, dict):
                raise EngineError("unexpected worker result", engine=self.name, result=str(r))
            if not r.get("ok"):
                err = worker_error(r.get("error") or {})
                if err.context.get("other_adapter"):  # refused: another adapter drives it
                    self.displaced, self._claimed = True, False
                raise err
        keys = ("root", "digests")
        if any(
            tuple(r.get(k) for k in keys) != tuple(results[0].get(k) for k in keys)
            for r in results[1:]
        ):
            raise EngineError("tensor-parallel ranks disagree on digests", engine=self.name)
        self.last_timings["worker_ms"] = max(float(r.get("ms", 0.0)) for r in results)
        self.last_boot = results[0].get("boot")
        phases = [
            dict(r.get("phases") or {}, **({"core_ms": r["core_ms"]} if "core_ms" in r else {}))
            for r in results
        ]
        for key in phases[0]:
            self.last_timings[key] = max(float(p.get(key, 0.0)) for p in phases)
        out = dict(results[0])
        tainted = next((r["tainted"] for r in results if r.get("tainted")), None)
        if tainted:  # TP > 1: one rank's failed write after a pause taints the engine
            out["tainted"] = tainted
        return out

    def _stage_steps(
        self, token: str, steps: Sequence[EncodedStep], options: Mapping[str, str]
    ) -> dict[str, Any]:
        """Stage ``steps`` in the workers under ``token``: the blobs and the spec go through
        the shared directory; returns the workers' staged result (:meth:`_wait_staged`)."""
        n = sum(len(step.blobs) for step in steps)
        with self.scratch.files("step", n) as blobs, self.scratch.files("stage") as (stage,):
            spec: list[dict[str, Any]] = []
            at = iter(blobs)
            for step in steps:
                paths = []
                for blob in step.blobs:
                    path = next(at)
                    path.write_bytes(blob)
                    paths.append(str(path))
                spec.append({"base": step.base, "target": step.target, "paths": paths})
            stage.write_text(json.dumps({"token": token, "steps": spec, **options}))
            self._call("stage", str(stage))
            return self._wait_staged(token)

    def _wait_staged(self, token: str) -> dict[str, Any]:
        """Poll every rank until all are ready (then they must agree: rank 0's answer), or
        one failed (its error; the other ranks' jobs are discarded)."""
        delay = 0.002
        while True:
            results = self._rpc("rollpatch_staged", token)
            states = [r.get("state") if isinstance(r, dict) else None for r in results]
            if all(st == "ready" for st in states):
                return self._gather(results)
            failed = [r for r, st in zip(results, states, strict=True) if st == "failed"]
            if failed or any(st is None for st in states):
                if failed:
                    with contextlib.suppress(RollpatchError):
                        self._call("discard", token)
                    raise worker_error(failed[0].get("failure") or {})
                self._gather(results)  # a worker's error (raised) or an unexpected answer
                raise EngineError("unexpected staging state", engine=self.name, states=str(states))
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _undo(self, key: str) -> None:
        """After a failed commit at TP > 1 (still paused): every rank that wrote puts its old
        words back (``rollpatch_undo``; a no-op on a rank with nothing to undo, and at TP 1).
        The engine-core hook does the same for its atomic commits (:mod:`.core`)."""
        with contextlib.suppress(RollpatchError):
            self._rpc("rollpatch_undo", key)

    def pause(self) -> None:
        """Freeze generation (requests in flight keep their place: ``mode=keep``)."""
        super().pause()

    def _freeze(self) -> None:
        if not self._claimed:  # a displaced adapter pauses no other adapter's engine
            self._claim()
        self.last_timings = {}
        self._timed("pause_call_ms", "/pause?mode=keep")

    def _thaw(self) -> None:
        self._timed("resume_call_ms", "/resume")

    def _timed(self, key: str, path: str, body: Any = None) -> Any:
        t0 = time.perf_counter()
        try:
            return self.http.post(path, body)
        finally:
            self.last_timings[key] = (time.perf_counter() - t0) * 1e3

    def release(self) -> None:
        """Stop driving the engine: another adapter may claim it at once, so what this one
        verified is void (``displaced``) until it sets a version again (a load or an
        adoption). It claims the engine again at its next call (refused while the other one
        calls)."""
        if self._claimed:
            self._claimed, self.displaced = False, True
            with contextlib.suppress(RollpatchError):
                self._gather(self._post_rpc("rollpatch_disown", [], {"owner": self.owner}))

    def close(self) -> None:
        """:meth:`release`, and forget the scratch directory (the server is not ours to
        stop)."""
        self.release()
        if self.http.nudger is not None:
            self.http.nudger.close()
        self.scratch.close()

    def _run(self, op: str, path: Path | str, official: bool) -> dict[str, Any]:
        if not official:
            return self._call(op, str(path))
        token = secrets.token_hex(8)
        try:
            self.http.post(
                "/update_weights",
                {"update_info": {"op": op, "path": str(path), "token": token, "owner": self.owner}},
            )
        finally:  # the workers keep the result (and any error) under the token
            res = self._rpc("rollpatch_result", token)
        return self._gather(res)


class RemoteWords:
    """A :class:`WordSource` over the engine's held tensors, fetched one tensor at a time.

    Each access copies one tensor out of the worker through the shared directory (cost: the
    tensor's bytes, written and read once). Prefer :meth:`VllmEngine.apply_encoded`, which
    decodes inside the worker and ships no words at all.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.engine.tensors()

    def __getitem__(self, name: str) -> Tensor:
        if name not in self:
            raise KeyError(name)
        with self.engine.scratch.files("words") as (path,):
            self.engine._call("export", name, str(path))
            return load_view(path)[name]


def worker_error(e: Mapping[str, Any]) -> RollpatchError:
    """The worker's error as a rollpatch exception (wrong bits keep their class)."""
    return engine_error(e, engine="vllm", what="worker")
