"""Change notification for one key of a directory store (Linux inotify, through ctypes).

A relay in front of a ``file://`` board learns that LATEST moved by reading it every
``watch_s``; with a :class:`KeyWatch` it wakes the moment the publisher renames the new LATEST
into place, so a version is announced without waiting out a polling period. Notification is an
optimisation only: the caller still reads (and verifies) the key, and keeps reading it every
``watch_s`` anyway, because writers on other hosts of a network file system raise no event
here. Where inotify is missing (not Linux, no libc symbol, the folder does not exist yet, the
watch limit is reached) :meth:`KeyWatch.open` returns None and the caller polls as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import sys
import time
from pathlib import Path

__all__ = ["KeyWatch"]

_IN_MODIFY = 0x002
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = 0o2000000
_MASK = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE_SELF | _IN_MOVE_SELF
#: Any of these: treat as "changed" (the folder went away, or events were lost).
_GONE = _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_Q_OVERFLOW | _IN_IGNORED
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
_READ_BYTES = 64 * 1024


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


class KeyWatch:
    """Wakes when the file at ``path`` is created, replaced or written (its folder watched)."""

    def __init__(self, fd: int, name: bytes) -> None:
        self._fd = fd
        self._name = name
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self.broken = False  # the folder went away or events were lost: poll instead

    @classmethod
    def open(cls, path: Path) -> KeyWatch | None:
        """A watch of ``path``'s folder for changes to ``path``; None where inotify is not
        available (the caller polls)."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, os.fsencode(path.parent), _MASK) < 0:
            os.close(fd)
            return None
        return cls(fd, os.fsencode(path.name))

    def wait(self, timeout: float) -> bool:
        """Whether the file changed within ``timeout`` seconds (True at once when the watch is
        broken: the caller then reads and should reopen or poll)."""
        deadline = time.monotonic() + timeout
        while not self.broken:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(max(0, int(left * 1000))):
                return False
            if self._drain():  # else: events about other files of the folder
                return True
        return True

    def _drain(self) -> bool:
        changed = False
        while True:
            try:
                data = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return changed
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                self.broken = True
                return True
            at = 0
            while at + _EVENT.size <= len(data):
                _, mask, _, n = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size : at + _EVENT.size + n].rstrip(b"\0")
                at += _EVENT.size + n
                if mask & _GONE:
                    self.broken = True
                    changed = True
                elif name == self._name:
                    changed = True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
