"""The services the issue 11 hardening tests wedge at: a real relay (uvicorn on loopback, 1 s
to send a request head) over an empty memory board, and sidecars and gateways started with
given serving options. The test_hardening_*.py modules import the ``board`` and ``relay``
fixtures by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the web extra installs fastapi")

from rollpatch.board import Board
from rollpatch.engines.view_engine import ViewEngine
from rollpatch.gateway import GatewayConfig
from rollpatch.gateway.server import RunningGateway, start_gateway
from rollpatch.relay import RelayConfig, RelayServer
from rollpatch.serving import ServeOptions
from rollpatch.sidecar import SidecarConfig
from rollpatch.sidecar.server import RunningSidecar, start_sidecar
from tests.conftest import dead_url

RUN = "r1"
TOKEN = "t0ken-xyz"


@pytest.fixture
def board(memory_board: Board) -> Board:
    return memory_board


@pytest.fixture
def relay(board: Board, tmp_path: Path) -> Iterator[RelayServer]:
    server = RelayServer(
        board.store,
        RelayConfig(cache_dir=tmp_path / "cache"),
        options=ServeOptions(header_timeout_s=1.0),
    )
    server.start()
    yield server
    server.stop()


def sidecar(
    tmp_path: Path, options: ServeOptions | None = None, **config: object
) -> RunningSidecar:
    """A sidecar of a run that has nothing published (its engine is never reached)."""
    return start_sidecar(
        f"file://{tmp_path / 'board'}",
        RUN,
        ViewEngine(),
        dead_url(),
        config=SidecarConfig(**config),
        options=options,
    )  # type: ignore[arg-type]


def gateway(
    islands: list[str], options: ServeOptions | None = None, **config: object
) -> RunningGateway:
    return start_gateway(
        islands,
        config=GatewayConfig(poll_s=0.05, **config),  # type: ignore[arg-type]
        options=options,
    )
