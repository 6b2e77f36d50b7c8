"""The channels between the adapter and SGLang (stdlib only): SGLang's HTTP routes
(:func:`http_json`), commands to rollpatch's loader through them, and the control socket.

**Commands on SGLang's weight-update route.** ``POST /update_weights_from_tensor`` with
``load_format`` naming rollpatch's custom weight loader (registered at launch with
``--custom-weight-loader``) makes SGLang's scheduler call the loader *between two forward
passes* with a list of (name, tensor). rollpatch sends one entry: the name is a JSON command,
the tensor an empty ``uint8`` tensor. SGLang's route takes each rank's list serialized the way
``torch.multiprocessing`` pickles it (read back by SGLang's allow-listing unpickler); for an
empty tensor those bytes are a fixed shape around the name, so :func:`command_payload` writes
them without importing torch: no storage, no shared memory, no file descriptor crosses.
Nothing rollpatch reads is ever unpickled.

**The control socket.** Reads and staging must not stall generation, so the loader also
starts a small server thread inside SGLang's process on a UNIX socket in the adapter's private
directory (mode 0700). One request per connection: one JSON line in (at most
:data:`MAX_LINE` bytes), one JSON line out. Bulk data (patches, keyframes, exported tensors)
travel as files in the same directory.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import EngineError, EngineUnreachableError, engine_error

__all__ = [
    "MAX_LINE",
    "command_payload",
    "http_json",
    "read_line",
    "request",
    "result",
    "step_files",
]

_MAX_BODY = 64 * 1024 * 1024

MAX_LINE = 1 << 24  # a digest list of a very large model stays far below this

# What ``ForkingPickler(protocol=2).dump([(NAME, torch.empty(0, dtype=torch.uint8))])`` writes
# (torch 2.x): before the name, and after it. tests/test_sglang.py checks them against torch.
_HEAD = b"\x80\x02]q\x00X"
_TAIL = (
    b"q\x01ctorch.multiprocessing.reductions\nrebuild_tensor\nq\x02ctorch\nTensor\nq\x03"
    b"ctorch.multiprocessing.reductions\nrebuild_typed_storage\nq\x04"
    b"ctorch.multiprocessing.reductions\nrebuild_storage_empty\nq\x05"
    b"ctorch.storage\nUntypedStorage\nq\x06\x85q\x07Rq\x08ctorch\nuint8\nq\t\x86q\nRq\x0b"
    b"(K\x00ctorch\nSize\nq\x0cK\x00\x85q\r\x85q\x0eRq\x0fK\x01\x85q\x10\x89tq\x11\x87q\x12"
    b"Rq\x13\x86q\x14a."
)


def command_payload(command: dict[str, Any]) -> str:
    """One rank's ``serialized_named_tensors`` entry (base64) carrying ``command``."""
    name = json.dumps(command, separators=(",", ":"), sort_keys=True).encode()
    return base64.b64encode(_HEAD + struct.pack("<I", len(name)) + name + _TAIL).decode()


def read_line(sock: socket.socket) -> bytes:
    """One newline-terminated line (without it), at most :data:`MAX_LINE` bytes."""
    chunks, size = [], 0
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise EngineError("the SGLang control socket closed mid-message")
        end = chunk.find(b"\n")
        if end >= 0:
            chunks.append(chunk[:end])
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_LINE:
            raise EngineError("the SGLang control message is too large", limit=MAX_LINE)


def request(path: str | Path, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request to the control socket at ``path``; returns the decoded answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            s.sendall(json.dumps(body, separators=(",", ":")).encode() + b"\n")
            raw = read_line(s)
    except OSError as err:
        raise EngineUnreachableError(
            f"the SGLang control socket is not reachable: {err}",
            path=str(path),
            op=body.get("op"),
            hint="is SGLang up, started with rollpatch's --custom-weight-loader? (docs/sglang.md)",
        ) from None
    try:
        out = json.loads(raw)
    except json.JSONDecodeError:
        raise EngineError("the SGLang control answer is not JSON", op=body.get("op")) from None
    if not isinstance(out, dict):
        raise EngineError("the SGLang control answer is not an object", op=body.get("op"))
    return out


def http_json(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    timeout: float,
    check: bool = True,
    token: str | None = None,
) -> Any:
    """One JSON call to SGLang's HTTP server; with ``check=False`` a 400 answer (SGLang's
    "did not succeed") is returned like a 200 one. Every other failure is an EngineError.
    ``token``: sent as ``Authorization: Bearer`` (SGLang's ``--api-key``)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read(_MAX_BODY + 1)
    except urllib.error.HTTPError as err:
        raw = err.read(_MAX_BODY + 1)
        if check or err.code != 400:
            raise EngineError(
                f"SGLang answered {err.code} to {method} {path}",
                engine="sglang",
                detail=raw[:500].decode(errors="replace"),
            ) from None
    except (urllib.error.URLError, OSError) as err:
        raise EngineUnreachableError(
            f"SGLang is not reachable: {err}",
            engine="sglang",
            url=base_url,
            path=path,
            hint="is the server up? (GET /health)",
        ) from None
    if len(raw) > _MAX_BODY:
        raise EngineError("SGLang's answer is too large", engine="sglang", path=path)
    try:
        return json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise EngineError("SGLang's answer is not JSON", engine="sglang", path=path) from None


def result(r: Mapping[str, Any]) -> dict[str, Any]:
    """An answer from inside SGLang as a dict, or its error as a rollpatch exception."""
    if not r.get("ok"):
        e = r.get("error") or {}
        raise engine_error(e, engine="sglang", what="SGLang extension")
    return dict(r)


def step_files(steps: Any, paths: Any) -> list[dict[str, Any]]:
    """The steps of a chain (``blobs``, ``base``, ``target`` each) written to files, one per
    object, in order from the iterator ``paths``: what a ``stage_encoded`` or
    ``decode_owned`` command names (each step's ``paths``, ``base``, ``target``)."""
    spec = []
    for step in steps:
        where = [next(paths) for _ in step.blobs]
        for path, blob in zip(where, step.blobs, strict=True):
            Path(path).write_bytes(blob)
        spec.append({"paths": [str(p) for p in where], "base": step.base, "target": step.target})
    return spec
