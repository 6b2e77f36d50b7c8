"""Shared test scaffolding: one home for the helpers several test modules need.

Test modules import helpers one way, as ``from tests.conftest import ...`` (or
``from tests.<helper module> import ...`` for the heavier, opt-in helpers: ``conftest_s3``
for the store backends, ``patchfix`` for codec fixtures, ``tlsfix``, ``vllm_env``).

Fixtures (found by name, nothing to import):

- ``tiny_model``: the reference engine's tiny Llama (seed 0), saved once per session in a
  directory named ``model`` (the name the reference engine serves);
- ``memory_board``, ``file_board``: an empty board on each local backend;
  ``any_board``: the same test on a memory, a file and an S3 board (moto's standalone server
  as a real process, from ``conftest_s3``; the S3 case follows its ROLLPATCH_SKIP_S3 rule);
- ``s3_server``: that moto server (session-scoped; it starts only when a test asks for it);
- ``live_vllm``, ``live_sglang``: the session's one vLLM / SGLang server
  (:mod:`tests.live_servers`), started in the background once collection shows a test that
  takes it; a module takes it with ``acquire()`` (boot weights held) and hands it back with
  ``release()``.

Helpers: :func:`free_port`, :func:`dead_url`, :func:`until` (wait for a condition, failing
with what was awaited), :func:`make_manifest` (a manifest with test defaults, built
keyword-only like the real publisher builds it), :func:`masters` / :func:`save_masters` (a
small checkpoint's master tensors), :func:`signing_world` (key pair, root and checkpoint made
through the real CLI) and :func:`hf_tiny_llama` (a trainer's transformers model in miniature).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.follower import FollowerConfig
from rollpatch.manifest import KeyframeObject, Manifest, PatchObject
from rollpatch.store import MemoryStore
from tests import live_servers
from tests.conftest_s3 import make_s3_store, s3_server
from tests.s3server import free_port

__all__ = [
    "DIGEST",
    "SigningWorld",
    "dead_url",
    "free_port",
    "hf_tiny_llama",
    "make_manifest",
    "masters",
    "s3_server",
    "save_masters",
    "signing_world",
    "until",
]

#: A well-formed target digest for manifests whose objects are opaque test bytes.
DIGEST = "a" * 64


def dead_url() -> str:
    """An http:// URL on a loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def until(cond: Callable[[], object], what: str, timeout: float = 30.0, poll: float = 0.02) -> None:
    """Wait until ``cond()`` is true; fail naming ``what`` after ``timeout`` seconds.

    The timeout is a liveness bound (a hung test fails instead of hanging CI), never a speed
    assertion: speed belongs to bench/.
    """
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def make_manifest(
    run: str,
    version: int,
    *,
    target: str = DIGEST,
    view_bytes: int = 1,
    patches: tuple[PatchObject, ...] = (),
    keyframes: tuple[KeyframeObject, ...] = (),
    shards: int = 1,
    parent: int | None | str = "previous",
    fmt: str = "bf16",
    created: float | None = None,
    publisher: str = "test",
) -> Manifest:
    """A manifest for ``run``/``version`` with test defaults.

    ``parent`` defaults to ``version - 1`` (``None`` for version 0); ``created`` to now.
    """
    par = (version - 1 if version else None) if parent == "previous" else parent
    assert par is None or isinstance(par, int)
    return Manifest(
        run=run,
        version=version,
        parent=par,
        format=fmt,
        target=target,
        view_bytes=view_bytes,
        created=time.time() if created is None else created,
        publisher=publisher,
        patches=patches,
        keyframes=keyframes,
        shards=shards,
    )


def masters(seed: int, step: float = 0.0) -> dict[str, np.ndarray]:
    """A small checkpoint's float32 master tensors (an embedding, an MLP weight, a norm):
    the same base for every ``seed``, moved by ``step`` times seeded noise."""
    rng = np.random.default_rng(0)
    out = {
        "model.embed_tokens.weight": rng.standard_normal((64, 128)).astype(np.float32) * 0.02,
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((256, 128)).astype(np.float32)
        * 0.02,
        "model.layers.0.input_layernorm.weight": np.ones(128, dtype=np.float32),
    }
    noise = np.random.default_rng(seed)
    return {k: v + step * noise.standard_normal(v.shape).astype(np.float32) for k, v in out.items()}


def save_masters(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Save master tensors as a safetensors checkpoint (what ``rollpatch cast`` reads)."""
    from rollpatch.io import save_view
    from rollpatch.view import Tensor, View

    save_view(View({k: Tensor.from_array(v) for k, v in tensors.items()}), path)


@dataclass(frozen=True)
class SigningWorld:
    """What ``rollpatch keygen`` and ``rollpatch root`` leave for a signed board, made
    through the real command line: the publisher's key pair, the board's first root (signed
    by it) and a checkpoint to publish. Nothing is published yet."""

    board: str
    key: Path
    pub: Path
    root: Path
    ckpt: Path


def signing_world(tmp_path: Path, name: str = "trainer") -> SigningWorld:
    """A :class:`SigningWorld` under ``tmp_path`` (a file:// board, key pair ``name``)."""
    from rollpatch.cli import main

    board = f"file://{tmp_path / 'board'}"
    assert main(["keygen", "-o", str(tmp_path / name)]) == 0
    key, pub, root = tmp_path / f"{name}.key", tmp_path / f"{name}.pub", tmp_path / "root.json"
    argv = ["root", "--board", board, "--key", str(pub), "--sign", str(key), "-o", str(root)]
    assert main(argv) == 0
    ckpt = tmp_path / "m.safetensors"
    save_masters(ckpt, masters(1))
    return SigningWorld(board, key, pub, root, ckpt)


def hf_tiny_llama(vocab_size: int = 96, max_positions: int = 64, **token_ids: int) -> Any:
    """A one-layer transformers ``LlamaForCausalLM`` (hidden 32, 2 heads, 1 KV head, untied
    head), float32, seeded (``torch.manual_seed(0)``): a trainer's model in miniature."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        **token_ids,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def run_bench(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """``bench/<script>`` run as a user runs it (its own process, this python), its stdout;
    a non-zero exit fails the test with the script's stderr."""
    bench = Path(__file__).resolve().parent.parent / "bench" / script
    got = subprocess.run(
        [sys.executable, str(bench), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    if got.returncode:
        pytest.fail(f"bench/{script} exited {got.returncode}:\n{got.stderr[-4000:]}")
    return got.stdout


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference engine's tiny Llama (seed 0), made once per session; read-only."""
    pytest.importorskip("torch")
    from rollpatch.engines.reference import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


#: A follower that polls, backs off and gives up quickly (tests on a memory board).
FAST_FOLLOWER = FollowerConfig(poll_s=0.05, backoff_s=0.01, timeout_s=30.0, retries=1)


@pytest.fixture
def reference_engine(tiny_model: Path) -> Iterator[Any]:
    """The built-in engine over :func:`tiny_model`: one thread, no HTTP server; torch's thread
    count (which the engine sets) is put back after."""
    import torch

    from rollpatch.engines.reference import ReferenceEngine

    threads = torch.get_num_threads()
    eng = ReferenceEngine.from_dir(tiny_model, threads=1, serve_http=False)
    yield eng
    eng.close()
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _rollpatch_logger_restored() -> Iterator[None]:
    """The ``rollpatch`` logger as each test found it: a service started in-process
    (``logs.configure``: its own handler, level, no propagation) must not change how a later
    test's records are printed or captured (a CLI test saw structured lines instead of its
    one-shot ones, depending on the order the suite ran in)."""
    import logging

    logger = logging.getLogger("rollpatch")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture
def ckpts(tmp_path: Path) -> tuple[Path, Path]:
    """Two master checkpoints (safetensors) a small step apart: (old, new)."""
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    save_masters(old, masters(1))
    save_masters(new, masters(2, step=1e-3))
    return old, new


@pytest.fixture
def memory_board() -> Iterator[Board]:
    """An empty board on a fresh memory:// store, dropped afterwards."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield Board(f"memory://{name}")
    MemoryStore.reset(name)


@pytest.fixture
def file_board(tmp_path: Path) -> Board:
    """An empty board in a fresh directory (file://)."""
    return Board(f"file://{tmp_path / 'board'}")


@pytest.fixture(params=["memory", "file", "s3"])
def any_board(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Board]:
    """An empty board on each backend a board is kept on: memory, file and S3 (moto)."""
    if request.param == "memory":
        yield request.getfixturevalue("memory_board")
    elif request.param == "file":
        yield Board(f"file://{tmp_path / 'board'}")
    else:
        store = make_s3_store(request)
        with store:
            yield Board(store)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the live engine servers the collected tests will take (their boot overlaps)."""
    if session.config.option.collectonly:
        return
    factory = session.config._tmp_path_factory  # type: ignore[attr-defined]
    live_servers.prestart(session.items, lambda kind: factory.mktemp(f"live-{kind}"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    live_servers.stop_all()


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The cached vLLM venv's python; the live vLLM tests fail, saying how to build it, when it
    is missing (``ROLLPATCH_SKIP_VLLM=1`` skips them on request)."""
    import os

    from tests import vllm_env

    if os.environ.get("ROLLPATCH_SKIP_VLLM") == "1":
        pytest.skip("ROLLPATCH_SKIP_VLLM=1: the live vLLM tests are skipped on request")
    python = vllm_env.vllm_python()
    if python is None:
        pytest.fail(f"no vLLM venv at {vllm_env.venv_dir()}: {vllm_env.BUILD_HINT}", pytrace=False)
    return python


@pytest.fixture(scope="session")
def live_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[live_servers.SharedServer]:
    """The session's vLLM server (tests.live_servers); modules ``acquire()`` it."""
    srv = live_servers.shared("vllm", lambda: tmp_path_factory.mktemp("live-vllm"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def live_sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[live_servers.SharedServer]:
    """The session's SGLang server (tests.live_servers); modules ``acquire()`` it."""
    srv = live_servers.shared("sglang", lambda: tmp_path_factory.mktemp("live-sglang"))
    yield srv
    srv.stop()
    srv.release()  # the sgl_kernel shim: still never called, now that SGLang has exited
