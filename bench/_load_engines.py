"""bench/serving_load.py's engines: a server on v0, the rollpatch engine in front of it, the
engine's own reload of a version under its pause, and the way back to v0 (untimed)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Literal

from _vllm_phases import back_to, reload_paused, settle
from _vllm_server import BenchError
from _vllm_world import World

EngineName = Literal["vllm", "sglang", "builtin"]


class Side(ABC):
    """One engine under test; :meth:`close` stops its server."""

    engine: Any
    url: str
    model: str

    def __init__(self, world: World, root: Path) -> None:
        self.world = world

    @abstractmethod
    def reload(self, v: int) -> tuple[float, float]:
        """The engine's own reload of version ``v`` (the version it holds) under its pause:
        the window (``time.monotonic()`` at the pause and at the resume); the engine is then
        told it holds ``v`` again."""

    @abstractmethod
    def back_to_v0(self) -> None:
        """Untimed: the engine on v0 again."""

    def settle(self) -> None:
        """Wait for what a commit writes after its pause (vLLM's kernel-only words)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the server."""


class VllmSide(Side):
    def __init__(self, world: World, root: Path, tp: int = 1) -> None:
        super().__init__(world, root)
        from _vllm_server import Server, vllm_python

        from rollpatch.engines.vllm import VllmEngine

        self.server = Server(vllm_python(), world.checkpoint(0), root / "vllm.log", tp=tp)
        try:
            self.server.wait_ready()
            self.engine = VllmEngine(self.server.url)
            self.engine.adopt(0, world.digests[0])
            self.engine.apply_encoded(world.patch_blob(1), 1)  # warm-up (imports, arenas)
            back_to(world, self.engine)
        except BaseException:
            self.close()
            raise
        self.url, self.model = self.server.url, str(self.server.model)

    def reload(self, v: int) -> tuple[float, float]:
        t0 = time.monotonic()
        reload_paused(self.engine.http, self.world.checkpoint(v), v)
        t1 = time.monotonic()
        self.engine.adopt(v, self.world.digests[v])
        return t0, t1

    def back_to_v0(self) -> None:
        back_to(self.world, self.engine)

    def settle(self) -> None:
        settle(self.engine)

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        self.server.stop()


class SglangSide(Side):
    def __init__(self, world: World, root: Path) -> None:
        super().__init__(world, root)
        from _sglang_chain import view_of
        from _sglang_server import Server

        from rollpatch.engines.sglang import SglangEngine

        self._view_of = view_of
        self.server = Server(world.checkpoint(0), root / "sglang.log")
        try:
            self.server.wait_ready()
            self.engine = SglangEngine(self.server.url)
            self.engine.adopt(0, world.digests[0])
        except BaseException:
            self.close()
            raise
        self.url, self.model = self.server.url, str(world.checkpoint(0))

    def reload(self, v: int) -> tuple[float, float]:
        ckpt = self.world.warm(v)  # page cache warm before the clock starts
        from _sglang_server import reload_paused as sglang_reload

        t0 = time.monotonic()
        sglang_reload(self.engine, ckpt, str(v))
        t1 = time.monotonic()
        self.engine.adopt(v, self.world.digests[v])  # untimed: a full re-hash in SGLang
        return t0, t1

    def back_to_v0(self) -> None:
        self.engine.load(self._view_of(self.world, 0), 0)

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        self.server.stop()


class BuiltinSide(Side):
    """rollpatch's built-in engine serving HTTP in this process, as inside the sidecar: its
    forward passes, the load's HTTP handling and the follower's staging share one process
    (and its GIL). Its "reload" is a keyframe load of the version (copy + full verify) under
    its pause, the built-in engine's full-reload path (bench/vllm.py's *reference_loads*)."""

    def __init__(self, world: World, root: Path) -> None:
        super().__init__(world, root)
        from rollpatch.engines.reference import ReferenceEngine

        self.engine = ReferenceEngine.from_dir(world.checkpoint(0), serve_http=True)
        try:
            self.back_to_v0()
        except BaseException:
            self.close()
            raise
        self.url, self.model = self.engine.url, self.engine.runtime.model_name

    def _view(self, v: int) -> Any:
        from rollpatch.io.safetensors import load_view

        return load_view(self.world.checkpoint(v) / "model.safetensors")

    def reload(self, v: int) -> tuple[float, float]:
        view = self._view(v)  # read before the pause, as a reload's page cache is warm
        t0 = time.monotonic()
        self.engine.pause()
        try:
            self.engine.load(view, v)
        finally:
            self.engine.resume()
        t1 = time.monotonic()
        if self.engine.digest != self.world.digests[v]:
            raise BenchError(f"v{v}: the built-in engine's keyframe load missed")
        return t0, t1

    def back_to_v0(self) -> None:
        self.engine.load(self._view(0), 0)

    def close(self) -> None:
        self.engine.close()


def start(name: EngineName, world: World, root: Path, tp: int = 1) -> Side:
    """The engine ``name`` serving v0 (``tp``: vLLM's tensor-parallel ranks)."""
    if name == "vllm":
        return VllmSide(world, root, tp)
    sides: dict[str, type[Side]] = {"sglang": SglangSide, "builtin": BuiltinSide}
    return sides[name](world, root)
