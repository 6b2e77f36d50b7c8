"""Cheap checks every command runs before it loads anything heavy (docs: README "Install").

A typo must cost milliseconds, not a model load: each check raises a :class:`ConfigError`
(one line, exit 2, printed by :func:`rollpatch.cli.main`) that names the option, the value and
the fix. Nothing here imports torch, transformers, the web stack or a cloud client; missing
extras are found with :func:`importlib.util.find_spec`, which imports nothing.

- :func:`require_extra`: the optional packages a command needs, or one line naming the extra;
- :func:`board_uri`: a known scheme with its parts (``memory://``, which a command's exit
  empties, refused), and (``existing=True``, for commands that only read) a local board
  directory that exists: ``status --board typo`` must not create one;
- :func:`input_file`, :func:`output_file`: a file to read exists and is not a directory; a
  file to write is not a directory, a symlink, a device, FIFO or socket, nor one of the
  command's inputs, and its directory exists (before any work is done);
- :func:`port_free`: the listening port can be bound (names it when it cannot);
- :func:`model_dir`: a local model directory with a ``config.json``;
- :func:`offline`: the Hugging Face libraries never contact the model hub.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import ConfigError, RollpatchError

__all__ = [
    "EXTRAS",
    "board_uri",
    "input_file",
    "local_board",
    "model_dir",
    "offline",
    "output_file",
    "port_free",
    "require_extra",
]

#: The modules behind each extra of ``pyproject.toml`` that commands import.
EXTRAS: dict[str, tuple[str, ...]] = {
    "web": ("fastapi", "uvicorn", "httpx", "pydantic", "prometheus_client"),
    "reference": ("torch", "transformers", "tokenizers", "fastapi", "uvicorn", "httpx"),
    "s3": ("boto3",),
    "plot": ("matplotlib",),
}
_SCHEMES = ("file", "s3", "http", "https", "memory")


def require_extra(extra: str, what: str) -> None:
    """Raise one line naming ``extra`` when a module it provides cannot be found."""
    missing = [m for m in EXTRAS[extra] if not _importable(m)]
    if missing:
        raise ConfigError(
            f"{what} needs the '{extra}' extra ({', '.join(missing)} not installed)",
            hint=f"pip install 'rollpatch[{extra}]'",
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def board_uri(uri: str, *, option: str = "--board", existing: bool = False) -> None:
    """Check a board URI's scheme and parts; with ``existing``, a local board must exist."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"{option} is empty", hint="a path, file://, s3://, http(s)://")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower() if "://" in uri else ""
    if scheme and scheme not in _SCHEMES:
        raise ConfigError(
            f"{option}: unknown board scheme '{scheme}://'",
            value=uri,
            hint="use a path, file://, s3://BUCKET/PREFIX, http(s)://RELAY",
        )
    if scheme == "memory":
        raise ConfigError(
            f"{option}: a memory:// board lives in this process only: what a command "
            "publishes there is gone when it exits, and a reader finds nothing",
            value=uri,
            hint="use a directory path, file://, s3://BUCKET/PREFIX or http(s)://RELAY",
        )
    if scheme == "file" and parts.netloc not in ("", "localhost"):
        raise ConfigError(
            f"{option}: a file:// board URI needs three slashes: {parts.netloc!r} would be "
            "read as a host name and dropped from the path",
            value=uri,
            hint=f"file:///{parts.netloc}{parts.path} (absolute), or the plain path "
            f"{parts.netloc}{parts.path} (relative to the current directory)",
        )
    if scheme == "s3" and not parts.netloc:
        raise ConfigError(
            f"{option}: an s3:// board needs a bucket", value=uri, hint="s3://BUCKET/PREFIX"
        )
    if scheme in ("http", "https") and not parts.hostname:
        raise ConfigError(
            f"{option}: an http(s):// board needs a host", value=uri, hint="http://RELAY-HOST:8470"
        )
    if scheme == "s3":
        require_extra("s3", "an s3:// board")
    path = local_board(uri)
    if existing and path is not None:
        if not path.exists():
            raise ConfigError(
                f"{option}: no board at {path} (the directory does not exist)",
                hint="check the path; a board is created by its first publish "
                "(create the directory to start a reader first)",
            )
        if not path.is_dir():
            raise ConfigError(f"{option}: {path} is not a directory", value=uri)


def local_board(uri: str) -> Path | None:
    """The directory of a local board URI (a path or ``file://``, as the store opens it:
    :func:`rollpatch.store.uri.file_path`); None for other schemes."""
    from ..store.uri import file_path

    path = file_path(uri)
    return None if path is None else Path(path).expanduser()


def input_file(path: str, what: str, *, folder: bool = False) -> None:
    """``path`` (``what`` names it: "checkpoint", "patch") is a file that exists (or, with
    ``folder``, a directory: a checkpoint folder, read by ``load_masters``)."""
    p = Path(path).expanduser()
    if folder and p.is_dir():
        return
    if p.is_dir():
        raise ConfigError(f"{what} {p} is a directory, not a file")
    if not p.exists():
        raise ConfigError(f"{what} not found: {p}")


def output_file(
    path: str,
    *,
    option: str = "-o",
    replace: bool = True,
    inputs: Sequence[str] = (),
    inside: Sequence[str] = (),
) -> None:
    """``path`` can be written: not a directory, in a directory that exists and takes a new
    file (a probe file is made and removed: a read-only mount or a full disk is said before
    the work, not after it); with ``replace=False``, no file is there yet.

    What is there may be replaced only when it is a regular file that is none of the
    command's ``inputs`` (files, or checkpoint folders: the files they are read from, index
    included) and lies under none of ``inside`` (a local board's directory). A symbolic
    link, a device node, a FIFO or a socket is refused: the write is a rename onto the path,
    which would replace the link or the node itself (an audit, session 41: ``-o /dev/full``
    as root replaced the device, ``cast X -o X`` the master checkpoint)."""
    p = Path(path).expanduser()
    if p.is_symlink():
        raise ConfigError(
            f"{option}: {p} is a symbolic link (writing replaces the link, not its target)",
            value=os.path.realpath(p),
            hint="give the link's target instead",
        )
    if p.is_dir():
        raise ConfigError(f"{option}: {p} is a directory", hint="name the file to write")
    if not p.parent.is_dir():
        raise ConfigError(
            f"{option}: the directory {p.parent} does not exist", hint="create it first"
        )
    if not replace and p.exists():
        raise ConfigError(f"{option}: {p} exists", hint="remove it first, or pass --force")
    _not_special(p, option)
    _not_an_input(p, option, inputs, inside)
    try:
        fd, probe = tempfile.mkstemp(prefix=".rollpatch-probe-", dir=p.parent)
    except OSError as e:
        raise ConfigError(
            f"{option}: cannot write in {p.parent}: {e.strerror or e}",
            hint="pick a writable directory",
        ) from None
    os.close(fd)
    os.unlink(probe)


_SPECIAL = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_special(p: Path, option: str) -> None:
    """Refuse an existing path that is not a regular file (a device node, FIFO, socket)."""
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"{option}: cannot stat {p}: {e.strerror or e}") from None
    if stat.S_ISREG(mode):
        return
    what = next((w for test, w in _SPECIAL if test(mode)), "not a regular file")
    raise ConfigError(
        f"{option}: {p} is {what}, not a regular file: it would be replaced by the output",
        hint="name a regular file (a new one, or one to replace)",
    )


def _not_an_input(p: Path, option: str, inputs: Sequence[str], inside: Sequence[str]) -> None:
    """Refuse ``p`` when it is one of the files ``inputs`` are read from, or lies under one
    of the directories ``inside`` (compared by inode where it exists, else by real path)."""
    real = os.path.realpath(p)
    for d in inside:
        top = os.path.realpath(Path(d).expanduser())
        if os.path.isdir(top) and os.path.commonpath([top, real]) == top:
            raise ConfigError(
                f"{option}: {p} is inside the board {d}: a board holds its own objects only",
                hint="write the output outside the board's directory",
            )
    for given in inputs:
        for f in _read_from(Path(given).expanduser()):
            if _same(p, f, real):
                said = "" if f == Path(given).expanduser() else f" (read from {given})"
                raise ConfigError(
                    f"{option}: {p} is an input of this command: {f}{said}; writing it would "
                    "replace the input",
                    hint="name another output file",
                )


def _read_from(given: Path) -> list[Path]:
    """The files an input is read from: itself, or a checkpoint folder's weight files and
    index files."""
    if not given.is_dir():
        return [given]
    from ..io.checkpoint import INDEX_FILES, checkpoint_files

    try:
        files, _ = checkpoint_files(given)
    except (RollpatchError, OSError):  # the command's own load says what is wrong with it
        files = []
    return [*files, *(given / n for n in INDEX_FILES if (given / n).exists())]


def _same(p: Path, f: Path, real: str) -> bool:
    try:
        return os.path.samefile(p, f)
    except OSError:  # one of them does not exist (yet)
        return real == os.path.realpath(f)


def port_free(host: str, port: int, *, option: str = "--port") -> None:
    """Raise naming the port when ``host:port`` cannot be listened on (port 0 always can)."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{option} must be a port number 0-65535", value=port)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            s.bind((host, port))
        except OSError as e:
            why = (
                "is already in use"
                if e.errno == errno.EADDRINUSE
                else f"cannot be bound: {e.strerror or e}"
            )
            raise ConfigError(
                f"{option}: port {port} on {host} {why}",
                hint=f"stop what holds it, or pick another {option} (0: any free port)",
            ) from None


def model_dir(path: str | None, *, option: str = "--model") -> Path:
    """A local model directory holding ``config.json`` (no model hub names)."""
    if not path:
        raise ConfigError(f"{option} is required", hint="a local model directory")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"{option}: no model directory at {p}",
            hint="a local directory with config.json and weights; model hub "
            "names are not used (rollpatch never downloads models)",
        )
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"{option}: {p} has no config.json",
            value=str(p),
            hint="point at a saved transformers model directory",
        )
    return p


def offline() -> None:
    """Keep transformers and huggingface_hub off the network (local files only)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
