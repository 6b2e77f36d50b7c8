"""Where an adapter finds the control socket of the adapter that drives an SGLang server, to
ask the loader whether it may start before it touches SGLang's weight-update routes.

Why: an adapter starts the loader's control threads through ``/begin_weight_update`` and
``/update_weights_from_tensor``, which take SGLang's model-update writer lock and so wait for
every request in flight and hold every new one. A second sidecar on a driven SGLang did that
before the loader refused it, at its start and at each retry: the first sidecar's short
requests took 6–28 s (an audit, session 40). Now the adapter that drives SGLang notes its
rank-0 control socket in a small file named by the server's URL (per user, in the temporary
directory both sides already share); another adapter asks that socket first (``claimable``:
the ownership check alone, :mod:`rollpatch.engines.ownership`) and is refused there, on the
control thread, without SGLang's locks. No file, a dead socket or an unreadable answer says
nothing: the start goes on as before (the loader's own claim still decides).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from ...errors import EngineError
from .wire import request, result

__all__ = ["ask", "forget", "note"]

_MAX_BYTES = 4096


def _path(url: str) -> Path:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = (parts.hostname or "").lower()
    host = "127.0.0.1" if host in ("localhost", "::1", "") else host
    key = hashlib.sha256(f"{host}:{parts.port or 80}".encode()).hexdigest()[:24]
    return Path(tempfile.gettempdir()) / f"rollpatch-{os.getuid()}" / f"sglang-{key}.json"


def note(url: str, socket: Path) -> None:
    """This adapter drives the SGLang at ``url`` through ``socket`` (rank 0's)."""
    path = _path(url)
    with contextlib.suppress(OSError):  # a hint for others only: never fails a start
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"socket": str(socket)}))
        os.replace(tmp, path)


def forget(url: str, socket: Path) -> None:
    """This adapter let go: its note goes, if it is still the one there."""
    path = _path(url)
    if _socket(path) == str(socket):
        with contextlib.suppress(OSError):
            path.unlink()


def ask(url: str, owner: str, timeout: float) -> None:
    """Raise the loader's refusal (``other_adapter``) when another adapter drives the SGLang
    at ``url`` and still holds it; return when it does not, or nothing can be told."""
    sock = _socket(_path(url))
    if sock is None:
        return
    try:
        answer = request(sock, {"op": "claimable", "owner": owner}, min(timeout, 10.0))
    except EngineError:  # no such socket any more, or it does not answer: nothing to say
        return
    try:
        result(answer)
    except EngineError as e:
        if e.context.get("other_adapter"):
            raise
        # any other answer (an older loader without the op): nothing to say


def _socket(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(_MAX_BYTES))
    except (OSError, ValueError):
        return None
    sock = doc.get("socket") if isinstance(doc, dict) else None
    return sock if isinstance(sock, str) and sock else None
