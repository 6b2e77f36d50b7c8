"""Assemble and run a sidecar: engine + follower + HTTP app (used by the CLI and the demo)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..board import Board
from ..engines.base import EngineAdapter
from ..engines.staged import WriteMode
from ..errors import ConfigError
from ..serving import ServerHandle, serve_app
from .service import Sidecar, SidecarConfig

if TYPE_CHECKING:
    from ..engines.vllm.adapter import Staging
    from ..engines.vllm.core import KvOnCommit

__all__ = ["ENGINES", "RunningSidecar", "make_engine", "start_sidecar"]

ENGINES = ("reference", "vllm", "sglang")


def make_engine(
    kind: str,
    *,
    model: str | None = None,
    engine_url: str | None = None,
    threads: int | None = None,
    writes: WriteMode = "in_place",
    kv_on_commit: str = "recompute",
    staging: str = "thread",
    engine_token: str | None = None,
) -> tuple[EngineAdapter, str]:
    """Build an engine adapter and the URL its OpenAI routes are served at (``writes``: the
    engine's :data:`~rollpatch.engines.staged.WriteMode`; ``kv_on_commit``: vLLM's
    :data:`~rollpatch.engines.vllm.core.KvOnCommit`: the reference engine always keeps the
    KV of requests in flight, SGLang always recomputes it; ``staging``: vLLM's
    :data:`~rollpatch.engines.vllm.adapter.Staging`; ``engine_token``: the vLLM or SGLang
    server's ``--api-key``)."""
    if kv_on_commit != "recompute" and kind != "vllm":
        raise ConfigError(
            f"--kv-on-commit {kv_on_commit} is for --engine vllm",
            hint="the reference engine always keeps the KV of requests in flight across a "
            "commit; SGLang always recomputes it",
        )
    if staging != "thread" and kind != "vllm":
        raise ConfigError(
            f"--staging {staging} is for --engine vllm",
            hint="the reference engine and SGLang stage in a thread while they serve",
        )
    if kind == "reference" and engine_token is not None:
        raise ConfigError("--engine-token-file is for --engine vllm or sglang")
    if kind == "reference":
        if model is None:
            raise ConfigError("--engine reference needs --model DIR")
        from ..engines.reference import ReferenceEngine

        ref = ReferenceEngine.from_dir(model, threads=threads, writes=writes)
        return ref, ref.url
    if engine_url is not None:  # the server's root: an OpenAI base URL's /v1 is dropped
        engine_url = engine_url.rstrip("/").removesuffix("/v1")
    if kind == "vllm":
        if engine_url is None:
            raise ConfigError("--engine vllm needs --engine-url http://HOST:PORT")
        from ..engines.vllm import VllmEngine

        kv = cast("KvOnCommit", kv_on_commit)
        where = cast("Staging", staging)
        vllm = VllmEngine(
            engine_url, writes=writes, kv_on_commit=kv, staging=where, token=engine_token
        )
        return vllm, engine_url
    if kind == "sglang":
        if engine_url is None:
            raise ConfigError("--engine sglang needs --engine-url http://HOST:PORT")
        from ..engines.sglang import SglangEngine

        return SglangEngine(engine_url, writes=writes, token=engine_token), engine_url
    raise ConfigError(f"unknown engine {kind!r}", hint=f"one of {', '.join(ENGINES)}")


@dataclass
class RunningSidecar:
    """A sidecar serving HTTP in this process."""

    sidecar: Sidecar
    server: ServerHandle

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        self.sidecar.stop()
        self.sidecar.engine.close()


def start_sidecar(
    board: str | Board,
    run: str,
    engine: EngineAdapter,
    engine_url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    config: SidecarConfig | None = None,
    **serve_kw: Any,
) -> RunningSidecar:
    """Start following ``run`` and serve the sidecar's app; returns once listening (on
    uvloop and httptools when installed: the proxy's per-event cost, docs/sidecar.md)."""
    from .app import create_app

    sc = Sidecar(board, run, engine, engine_url, config)
    sc.start()
    serve_kw.setdefault("loop", "fast")
    serve_kw.setdefault("http", "fast")
    server = serve_app(create_app(sc), host, port, name="sidecar", **serve_kw)
    return RunningSidecar(sc, server)
