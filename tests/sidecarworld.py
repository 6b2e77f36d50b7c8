"""The live sidecar tests' world (tests/test_vllm_sidecar*.py, tests/test_sglang_sidecar.py):
the tiny model's versions (FP32 masters plus small noise, as an RL step) and a board they are
published on; for vLLM also the session's server and the module's fixtures; ``rollpatch
sidecar`` as a process of its own (:func:`sidecar_process`, the TP 2 modules).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.follower import FollowerConfig
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig
from tests import live_servers, vllm_env

RUN = "rl"
FAST = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=60.0)
#: FAST, and an engine with no version adopts the published version its words hash to.
ADOPT = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=60.0, boot="adopt")
BOOT_LATEST = 5  # published before the joining replica starts (it boots on version 0)
N_VERSIONS = 20  # views prepared; the tests publish more as they go


class World:
    """The tiny model, its versions (FP32 masters plus small noise, as an RL step), a board."""

    def __init__(
        self, root: Path, boot: Path, *, seed: int = 11, versions: int = N_VERSIONS
    ) -> None:
        from rollpatch.io.safetensors import load_view

        masters = {
            n: t.to_array().astype(np.float32)
            for n, t in load_view(boot / "model.safetensors").items()
        }
        rng = np.random.default_rng(seed)
        self.masters: list[dict[str, np.ndarray]] = []
        for _ in range(versions):
            self.masters.append({n: m.copy() for n, m in masters.items()})
            for m in masters.values():
                m += (3e-3 * float(m.std())) * rng.standard_normal(m.shape).astype(np.float32)
        self.views = [cast_view(m, "bf16") for m in self.masters]
        # the model directory vLLM booted from holds version 0's view (an older keyframe)
        self.model = boot
        assert load_view(boot / "model.safetensors").digest() == self.views[0].digest()
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(
            self.board, RUN, PublisherConfig(keyframe_every=0, skip_strides=()), asynchronous=False
        )
        self.latest = -1
        self.lock = threading.Lock()
        while self.latest < BOOT_LATEST:
            self.publish()

    def publish(self) -> int:
        with self.lock:
            v = self.publisher.publish(self.masters[self.latest + 1])
            assert v == self.latest + 1
            self.latest = v
            return v


@pytest.fixture(scope="module")
def server(vllm_python: Path, live_vllm: live_servers.SharedServer) -> Iterator[vllm_env.Server]:
    """The session's vLLM server (tests.live_servers: started with ROLLPATCH_FAULT_INJECTION=1
    for rollpatch_flip, the audit test's fault), holding the live tiny model's weights."""
    pytest.importorskip("transformers")
    pytest.importorskip("openai")
    srv = live_vllm.acquire()
    yield srv
    live_vllm.release()


@pytest.fixture(scope="module")
def world(
    request: pytest.FixtureRequest,
    server: vllm_env.Server,
    live_vllm: live_servers.SharedServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> World:
    """The module's world: ``WORLD_VERSIONS`` versions where the test module sets it (one
    that publishes a race-dependent number of them), else :data:`N_VERSIONS`."""
    versions = int(getattr(request.module, "WORLD_VERSIONS", N_VERSIONS))
    return World(tmp_path_factory.mktemp("vllm-sidecar"), live_vllm.model, versions=versions)


def ready_then_hold_loads(
    url: str, engine: Any, deadline: float, *, hold_s: float = 30.0
) -> tuple[threading.Event, list[int]]:
    """Wait for the sidecar at ``url`` to be ready, then hold the engine's next loads (the
    re-sync) until the event is set (at most ``hold_s``), recording their versions: a test
    sees ``/ready`` answer 503 before the engine is back."""
    import httpx

    while httpx.get(f"{url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.02)
    seen, loaded, load = threading.Event(), [], engine.load

    def held_load(view: Any, version: int) -> None:  # hold the re-sync until /ready 503
        seen.wait(hold_s)
        loaded.append(version)
        load(view, version)

    engine.load = held_load
    return seen, loaded


def until_back_on(sc: Any, version: int, deadline: float) -> None:
    """Until the sidecar ``sc`` is ready again on the verified ``version``."""
    import httpx

    while not (
        httpx.get(f"{sc.url}/ready").status_code == 200 and sc.sidecar.follower.version == version
    ):
        assert time.monotonic() < deadline, "never came back on a verified version"
        time.sleep(0.02)


@contextlib.contextmanager
def spawn(
    board: str, run: str, tmp: Path, args: list[str]
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``rollpatch sidecar --board BOARD --run RUN ARGS`` as its own process (state under
    ``tmp``): yields it and its log file (stdout and stderr), stops it after."""
    log = tmp / "sidecar.log"
    cmd = [sys.executable, "-m", "rollpatch", "sidecar", "--board", board, "--run", run, *args]
    env = dict(os.environ, XDG_STATE_HOME=str(tmp / "state"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], log: Path, url: str, timeout: float) -> None:
    """Until the sidecar at ``url`` answers ``/ready`` 200 (its log's tail if it exits)."""
    import httpx

    from tests.conftest import until

    def ready() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    until(ready, "the sidecar to be ready", timeout=timeout)


@contextlib.contextmanager
def sidecar_process(
    board: str, engine: str, engine_url: str, tmp: Path, *extra: str
) -> Iterator[str]:
    """``rollpatch sidecar --engine ENGINE`` (``extra``: more options) as its own process in
    front of ``engine_url``, following :data:`RUN` on ``board`` (state and log under ``tmp``):
    yields its URL once ``/ready`` (300 s), stops it after."""
    from tests.conftest import free_port

    port = free_port()
    args = ["--engine", engine, "--engine-url", engine_url, "--port", str(port)]
    with spawn(board, RUN, tmp, [*args, "--poll", "0.05", *extra]) as (proc, log):
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, log, url, 300)
        yield url
