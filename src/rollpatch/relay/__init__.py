"""The regional relay: a read-only, caching, coalescing board server (see ``docs/relay.md``)::

    from rollpatch.relay import RelayConfig, RelayServer
    server = RelayServer("s3://bucket/board", RelayConfig(cache_dir=Path("/var/cache/rp")))
    url = server.start()          # followers: Board(open_store(url))

Islands in a region read the board through one relay, which fetches each immutable object
across the WAN once (concurrent requests coalesce onto one fetch), verifies it (BLAKE3 for
objects, strict parsing for manifests) and keeps it in a bounded disk cache; LATEST and
listings are passed through with a short TTL. Relays chain: a relay's board may be
``http://another-relay``.

:class:`Relay` (``core``) is the logic without HTTP; :class:`RelayServer` and
:func:`create_app` (``server``) need the ``web`` extra (fastapi, uvicorn), imported on use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cache import CacheEntry, DiskCache
from .config import KeyKind, RelayConfig, classify
from .core import Blob, Relay
from .metrics import Metrics

if TYPE_CHECKING:
    from .server import RelayServer, create_app

__all__ = [
    "Blob",
    "CacheEntry",
    "DiskCache",
    "KeyKind",
    "Metrics",
    "Relay",
    "RelayConfig",
    "RelayServer",
    "classify",
    "create_app",
]


def __getattr__(name: str) -> Any:
    if name in ("RelayServer", "create_app"):  # fastapi and uvicorn are an optional extra
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
