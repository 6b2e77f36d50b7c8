"""One live engine server of each kind (vLLM, SGLang) per test session, shared by the modules.

A stock vLLM or SGLang takes 30-60 s of CPU to start on two cores, so the session starts each
one once: in the background, as soon as collection shows a test that will take it
(:func:`prestart`, called from ``tests/conftest.py``), so that its boot, health wait and first
(compiling) request overlap the tests that run before it. Both boot from the live tests' tiny
Llama (:data:`LIVE_MODEL`, seed 0), written once per session.

A module takes the server with :meth:`SharedServer.acquire` in its module-scoped ``server``
fixture and gets it holding the boot weights: the first module gets the freshly booted server;
every later one gets it after a keyframe of the boot view was loaded in place through the
engine's adapter, which verifies the digest the engine's workers compute (a failed reset fails
that module's tests, naming the server's log). :meth:`SharedServer.release` checks what the
module's server must not have done (SGLang: call its ``sgl_kernel`` import shim).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from tests import sglang_env, vllm_env

Kind = Literal["vllm", "sglang"]
KINDS: tuple[Kind, ...] = ("vllm", "sglang")

#: The tiny Llama every live engine test boots from (``make_tiny_model``'s keywords; seed 0).
LIVE_MODEL: dict[str, int] = {
    "hidden_size": 256,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 512,
    "vocab_size": 2048,
}

#: The fixture names that take each kind's shared server (see tests/conftest.py).
FIXTURES: dict[Kind, str] = {"vllm": "live_vllm", "sglang": "live_sglang"}


def python_for(kind: Kind) -> Path | None:
    """The kind's venv python, or None when it is not built (or skipped on request)."""
    if kind == "vllm":
        if os.environ.get("ROLLPATCH_SKIP_VLLM") == "1":
            return None
        return vllm_env.vllm_python()
    return sglang_env.sglang_python()


@dataclass
class SharedServer:
    """One engine server for the session: started once, reset between the modules using it."""

    kind: Kind
    root: Path
    model: Path = field(init=False)
    server: vllm_env.Server | None = None
    error: BaseException | None = None
    users: int = 0
    _boot: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.model = self.root / "model"
        self.shim_log = self.root / "sgl-kernel-shim.log"

    def start(self) -> None:
        """Write the model and start the server; its boot and warm-up go on in a thread."""
        if self.server is not None or self.error is not None:
            return
        try:
            python = python_for(self.kind)
            if python is None:
                raise RuntimeError(f"no {self.kind} venv to start a server from")
            from rollpatch.engines.reference import make_tiny_model

            with contextlib.redirect_stderr(io.StringIO()):  # no progress bars mid-collection
                make_tiny_model(self.model, **LIVE_MODEL)
            log = self.root / f"{self.kind}.log"
            if self.kind == "vllm":
                self.server = vllm_env.start_server(
                    python,
                    self.model,
                    log,
                    extra=["--weight-transfer-config", '{"backend": "rollpatch"}'],
                    # rollpatch_flip, for test_vllm_sidecar's audit test
                    env={"ROLLPATCH_FAULT_INJECTION": "1"},
                )
            else:
                self.server = sglang_env.start_server(
                    python,
                    self.model,
                    log,
                    self.shim_log,
                    # the loader's forget, for test_sglang_sidecar's restart test
                    extra_env={"ROLLPATCH_FAULT_INJECTION": "1"},
                )
        except Exception as e:  # noqa: BLE001 - raised again, in context, by acquire()
            self.error = e
            return
        self._boot = threading.Thread(target=self._warm, name=f"boot-{self.kind}", daemon=True)
        self._boot.start()

    def _warm(self) -> None:
        srv = self.server
        assert srv is not None
        try:
            srv.wait_ready(300)
            if self.kind == "vllm":  # the first request compiles: done here, off the tests
                srv.post(
                    "/v1/completions",
                    {"model": str(self.model), "prompt": "warm up", "max_tokens": 2},
                    timeout=300,
                )
        except BaseException as e:  # noqa: BLE001 - raised again by acquire()
            self.error = e

    def acquire(self) -> vllm_env.Server:
        """The ready server, holding the boot weights (reset if a module used it before)."""
        self.start()
        if self._boot is not None:
            self._boot.join()
        if self.error is not None or self.server is None:
            tail = self.server.tail() if self.server is not None else ""
            pytest.fail(f"the shared {self.kind} server did not start: {self.error}\n{tail}")
        srv = self.server
        if srv.proc.poll() is not None:
            pytest.fail(
                f"the shared {self.kind} server exited ({srv.proc.returncode}):\n{srv.tail()}"
            )
        if self.users:
            try:
                self._reset(srv)
            except Exception as e:  # noqa: BLE001 - the module's tests fail with the log
                pytest.fail(f"resetting the shared {self.kind} server failed: {e!r}\n{srv.tail()}")
        self.users += 1
        return srv

    def _reset(self, srv: vllm_env.Server) -> None:
        """Load the boot view in place (a keyframe, verified by the adapter) as version 0."""
        from rollpatch.io.safetensors import load_view

        boot = load_view(self.model / "model.safetensors")
        eng: Any
        if self.kind == "vllm":
            from rollpatch.engines.vllm import VllmEngine

            eng = VllmEngine(srv.url)
        else:
            from rollpatch.engines.sglang import SglangEngine

            eng = SglangEngine(srv.url)
        try:
            eng.load(boot, 0)
            assert eng.held(fresh=True)[1] == boot.digest(), "the reset server lost the boot view"
        finally:
            eng.close()

    def release(self) -> None:
        """After a module: SGLang must not have called its ``sgl_kernel`` import shim."""
        if self.kind == "sglang":
            calls = self.shim_log.read_text() if self.shim_log.exists() else ""
            assert calls == "", f"SGLang called the sgl_kernel shim:\n{calls}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._boot is not None:
            self._boot.join(10)


_SHARED: dict[Kind, SharedServer] = {}


def shared(kind: Kind, root: Callable[[], Path]) -> SharedServer:
    """The session's server of ``kind`` (created, not started, on first use)."""
    if kind not in _SHARED:
        _SHARED[kind] = SharedServer(kind, root())
    return _SHARED[kind]


def prestart(items: list[pytest.Item], root: Callable[[Kind], Path]) -> None:
    """Start, in the background, each kind's server that a collected test will take."""
    for kind in KINDS:
        if python_for(kind) is None:
            continue  # the module's own fixtures skip or fail, saying why
        if any(FIXTURES[kind] in getattr(it, "fixturenames", ()) for it in items):
            shared(kind, lambda kind=kind: root(kind)).start()


def stop_all() -> None:
    """Stop every shared server (also those whose tests were all skipped before taking them)."""
    while _SHARED:
        _, srv = _SHARED.popitem()
        srv.stop()
