"""The POSIX pieces :class:`~rollpatch.store.file.FileStore` is built from: OSError → store
errors, what counts as an object (regular files only), exact positional reads."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator

from ..errors import NotAnObjectError, StoreError

__all__ = [
    "ABSENT",
    "clash",
    "enter_dir",
    "is_dir_at",
    "is_link_at",
    "is_regular",
    "not_object",
    "os_errors",
    "pread_exact",
    "unlink_at",
]


@contextlib.contextmanager
def os_errors(op: str, key: str, uri: str) -> Iterator[None]:
    """Turn an unexpected OSError (disk full, permissions, I/O) into a StoreError."""
    try:
        yield
    except StoreError:
        raise
    except OSError as e:
        raise StoreError(
            f"{op} failed: {e.strerror or e}",
            key=key,
            store=uri,
            errno=errno.errorcode.get(e.errno or 0),
        ) from e


#: errno values that mean "no such object here".
ABSENT = (errno.ENOENT, errno.ENOTDIR)


def not_object(key: str, uri: str, mode: int) -> NotAnObjectError:
    """Absent, saying what else has the name (only regular files are objects)."""
    kind = (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a file"
    )
    return NotAnObjectError(
        f"no such object ({kind} has that name; only regular files are objects)", key=key, store=uri
    )


def clash(key: str, uri: str) -> StoreError:
    """The error for a key whose path is (or runs through) a file where a folder must be."""
    return StoreError(
        "key clashes with another key: a directory store cannot hold both 'a' and 'a/b'",
        key=key,
        store=uri,
        hint="use key layouts where no key is a prefix-folder of another",
    )


def is_regular(fd: int) -> bool:
    """Whether the open descriptor is a regular file (not a FIFO, device, socket, folder)."""
    return stat.S_ISREG(os.fstat(fd).st_mode)


def pread_exact(fd: int, offset: int, size: int, key: str) -> bytes:
    """Exactly ``size`` bytes at ``offset`` (StoreError if the file shrank meanwhile)."""
    chunks: list[bytes] = []
    done = 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 1 << 30), offset + done)  # Linux caps ~2 GiB/call
        if not chunk:
            raise StoreError("object shrank while being read", key=key)
        chunks.append(chunk)
        done += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def is_dir_at(fd: int, name: str) -> bool:
    """Whether ``name`` in the folder ``fd`` is a folder (a link is not followed)."""
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def is_link_at(fd: int, name: str) -> bool:
    """Whether ``name`` in the folder ``fd`` is a symbolic link."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def unlink_at(fd: int, name: str) -> None:
    """Remove ``name`` from the folder ``fd`` if it is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=fd)


def enter_dir(fd: int, segment: str, key: str, uri: str, made: Callable[[int], None]) -> int:
    """The folder ``segment`` of the folder ``fd`` (``fd`` is closed), made if missing (then
    ``made(fd)``: the parent's fsync), never through a link: a link, or a file, where a folder
    must be is refused (``key`` and ``uri`` name it)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    for _ in range(3):  # another process may make (or remove) it meanwhile
        try:
            nxt = os.open(segment, flags, dir_fd=fd)
        except FileNotFoundError:
            try:
                os.mkdir(segment, dir_fd=fd)
            except FileExistsError:
                continue
            made(fd)
            continue
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and is_link_at(fd, segment):
                raise StoreError(
                    "a symbolic link where the board needs a folder: not followed",
                    key=key,
                    store=uri,
                    folder=segment,
                    hint="the board's folders must be real folders (something wrote a link "
                    "into the board)",
                ) from None
            if e.errno == errno.ENOTDIR:
                raise clash(key, uri) from None
            raise
        os.close(fd)
        return nxt
    raise StoreError("a folder of the key keeps changing", key=key, store=uri)
