"""One rollout island: ``python -m rollpatch.demo.island --name N --board URI --model DIR``.

A sidecar (follower + drain-mode commit gate + HTTP front) over one engine, in its own
process. Besides serving, it reports every verified commit as an event (version, wall time,
the engine's digest after the commit), which the orchestrator uses for time-to-version and
to check, independently of the follower, that each digest is the board's target.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..trust import Trust
from .events import emit, watch_parent

__all__ = ["main", "make_island_engine"]


def make_island_engine(
    kind: str, *, model: str, fmt: str, engine_url: str | None
) -> tuple[Any, str]:
    """The engine adapter and its OpenAI URL (``make_engine``, with the served dtype)."""
    from ..sidecar.server import make_engine

    if kind == "reference" and fmt == "fp16":  # make_engine's reference engine is bf16
        from ..engines.reference import ReferenceEngine

        engine = ReferenceEngine.from_dir(model, dtype="float16", threads=1)
        return engine, engine.url
    if kind == "reference" and fmt != "bf16":
        raise ConfigError(f"the reference engine cannot serve {fmt}", hint="--engine vllm")
    return make_engine(kind, model=model, engine_url=engine_url, threads=1)


def main(argv: Sequence[str] | None = None) -> int:
    from ..board import Board
    from ..follower import FollowerConfig
    from ..serving import serve_app
    from ..sidecar import Sidecar, SidecarConfig
    from ..sidecar.app import create_app
    from ..sidecar.server import RunningSidecar
    from ..store import open_reader_store

    p = argparse.ArgumentParser(prog="python -m rollpatch.demo.island")
    p.add_argument("--name", required=True)
    p.add_argument("--board", required=True, help="file:// board or http:// relay")
    p.add_argument("--run", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--format", default="bf16")
    p.add_argument("--engine", default="reference")
    p.add_argument("--engine-url")
    p.add_argument("--poll", type=float, default=0.1)
    p.add_argument("--trust", help="trust root file: verify every manifest and LATEST")
    p.add_argument("--trust-state", help="rollback-protection state file")
    args = p.parse_args(argv)

    stop = threading.Event()
    watch_parent(lambda cmd: stop.set() if cmd.get("cmd") == "stop" else None, stop.set)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        engine, url = make_island_engine(
            args.engine, model=args.model, fmt=args.format, engine_url=args.engine_url
        )
    except Exception as e:  # noqa: BLE001 (told to the orchestrator, then the process ends)
        emit("error", where=f"island {args.name}", message=f"{type(e).__name__}: {e}")
        return 2
    config = SidecarConfig(commit_mode="drain", follower=FollowerConfig(poll_s=args.poll))
    trust = (
        None
        if args.trust is None
        else Trust.from_file(
            args.trust, state_path=None if args.trust_state is None else Path(args.trust_state)
        )
    )
    sc = Sidecar(Board(open_reader_store(args.board), trust=trust), args.run, engine, url, config)

    def on_commit(version: int, pause_s: float) -> None:
        emit(
            "commit",
            island=args.name,
            version=version,
            t=time.time(),
            digest=engine.digest,
            pause_s=pause_s,
        )

    sc.follower.on_commit.append(on_commit)  # before start: the boot commit is reported too
    sc.start()
    running = RunningSidecar(sc, serve_app(create_app(sc), "127.0.0.1", 0, name="sidecar"))
    emit("listening", island=args.name, url=running.url, engine_url=url)
    try:
        stop.wait()
    finally:
        running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
