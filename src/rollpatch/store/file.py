"""``file://DIR``: the embedded default store, a directory tree safe for many processes.

Layout: the object ``a/b/c`` is the file ``DIR/a/b/c``. Bookkeeping lives in names starting
with ``.rp-`` (which keys may not use): ``.rp-tmp-*`` files beside their target while being
written, and ``DIR/.rp-locks/`` for compare-and-swap.

How each guarantee is kept:

- durable: data is written to a temp file in the target's directory and fsynced; then it is
  linked into place and the directory is fsynced (new directories' parents too).
- put-if-absent: ``os.link(tmp, final)`` fails with ``EEXIST`` when ``final`` exists, atomically,
  in the kernel, so of many racing processes exactly one wins; nobody ever sees a partial file.
- cas: an exclusive ``flock`` on a per-key lock file, then read-compare, then ``os.replace``
  (or ``os.link`` when the expectation is "absent", so it cannot clobber a racing ``put``).
- only regular files are objects: reads, ``head`` and ``list`` walk the key's path one
  segment at a time without following symbolic links (``O_NOFOLLOW`` relative to the parent
  folder's descriptor), and never open a FIFO, socket or device; such names read as absent and
  are not listed. So a link planted in the board cannot serve ``/etc/passwd``, and a FIFO
  cannot hang a reader. (The root itself may be a link: the operator chose it.)
- writes (``put``, ``cas``, ``delete``, the lock files) work the same way, on folder
  descriptors reached from the root without following links, and create, link, rename and
  unlink names relative to them: a link planted in the board cannot send the writer's objects,
  pointers or deletions outside it; a link where a folder must be is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import (
    AlreadyExistsError,
    ConflictError,
    NotAnObjectError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from .base import (
    RESERVED_SEGMENT_PREFIX,
    ObjectInfo,
    Store,
    cas_lost,
    check_bounds,
    too_large,
    validate_key,
)
from .notify import KeyWatch
from .posix import (
    ABSENT,
    clash,
    enter_dir,
    is_dir_at,
    is_regular,
    not_object,
    os_errors,
    pread_exact,
    unlink_at,
)

__all__ = ["FileStore"]

_LOCK_DIR = ".rp-locks"
_TMP_PREFIX = ".rp-tmp-"


class FileStore(Store):
    """A store in a local (or shared POSIX) directory.

    ``fsync=False`` skips the fsyncs: faster, for scratch data and tests only, since a power
    loss may then lose or truncate objects that ``put`` already returned for.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        path = Path(root).expanduser()
        if not path.is_absolute():
            path = Path.cwd() / path
        self.root = Path(os.path.normpath(path))
        self.fsync = fsync
        #: Whether this open made the root directory (a new board; or a mistyped path, or a
        #: mount that is not there: ``rollpatch publish`` says so).
        self.created = not self.root.exists()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the store directory: {e.strerror}", root=str(self.root)
            ) from e
        if not self.root.is_dir():
            raise StoreError("the store root is not a directory", root=str(self.root))
        self.uri = self.root.as_uri()

    # -- reads --------------------------------------------------------------------------------

    def watch(self, key: str) -> KeyWatch | None:
        """A :class:`~rollpatch.store.notify.KeyWatch` that wakes when ``key`` is written
        (None: no inotify here, or its folder does not exist yet; poll instead)."""
        return KeyWatch.open(self._path(validate_key(key)))

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def _open_dir(self, parts: list[str]) -> int:
        """A descriptor of the folder ``root/parts...``, no link followed below the root. The
        root itself missing is an outage, not an empty board: it existed when the store was
        opened (an unmounted or moved board read as "nothing published", so an island
        forgot LATEST and served ``max_lag`` unchecked: found by an audit, session 39)."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            if e.errno not in ABSENT:
                raise
            raise TransientStoreError(
                "the store directory is gone (unmounted, moved or deleted?)", root=str(self.root)
            ) from None
        try:
            for segment in parts:
                nxt = os.open(segment, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _lstat(self, key: str) -> os.stat_result | None:
        """``lstat`` of the key's file reached without following links; None if absent."""
        *folders, name = key.split("/")
        try:
            fd = self._open_dir(folders)
        except OSError as e:
            if e.errno in ABSENT:
                return None
            raise
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError as e:
            if e.errno in ABSENT:
                return None
            raise
        finally:
            os.close(fd)

    def _open_read(self, key: str) -> int:
        *folders, name = key.split("/")
        try:
            folder = self._open_dir(folders)
            try:
                st = os.stat(name, dir_fd=folder, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):  # never open a FIFO or device: it may block
                    raise not_object(key, self.uri, st.st_mode)
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
            finally:
                os.close(folder)
        except OSError as e:
            if e.errno in ABSENT:
                raise NotFoundError("no such object", key=key, store=self.uri) from None
            if e.errno == errno.ELOOP:
                raise not_object(key, self.uri, stat.S_IFLNK) from None
            raise StoreError(f"cannot open object: {e.strerror}", key=key, store=self.uri) from e
        if not is_regular(fd):  # swapped between the stat and the open
            os.close(fd)
            raise not_object(key, self.uri, 0)
        return fd

    def _get(self, key: str) -> bytes:
        return self._get_bounded(key, None)

    def _get_bounded(self, key: str, max_bytes: int | None) -> bytes:
        with os_errors("get", key, self.uri):
            fd = self._open_read(key)
            try:
                size = os.fstat(fd).st_size
                if max_bytes is not None and size > max_bytes:
                    raise too_large(key, self.uri, size, max_bytes)
                return pread_exact(fd, 0, size, key)
            finally:
                os.close(fd)

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        with os_errors("get_range", key, self.uri):
            fd = self._open_read(key)
            try:
                check_bounds(key, start, end, os.fstat(fd).st_size)
                return pread_exact(fd, start, end - start, key)
            finally:
                os.close(fd)

    def _head(self, key: str) -> ObjectInfo | None:
        with os_errors("head", key, self.uri):
            st = self._lstat(key)
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(
            key=key,
            size=st.st_size,
            etag=f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}",
            modified=st.st_mtime,
        )

    def _list(self, prefix: str) -> list[str]:
        base_key, _, tail = prefix.rpartition("/")
        base = base_key.split("/") if base_key else []
        pending = [base]
        keys: list[str] = []
        while pending:  # iterative: one folder open at a time, links never entered
            parts = pending.pop()
            at_base = parts == base  # folders below the base have longer paths
            try:
                fd = self._open_dir(parts)
            except OSError as e:
                if e.errno in ABSENT or e.errno == errno.ELOOP:
                    continue
                raise StoreError(f"list failed: {e.strerror}", prefix=prefix, store=self.uri) from e
            rel = "".join(f"{p}/" for p in parts)
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        name = entry.name
                        if at_base and not name.startswith(tail):
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            if not name.startswith(RESERVED_SEGMENT_PREFIX):
                                pending.append([*parts, name])
                        elif entry.is_file(follow_symlinks=False):
                            key = rel + name
                            if key.startswith(prefix) and _is_key(key):
                                keys.append(key)
            finally:
                os.close(fd)
        return sorted(keys)

    # -- writes (module docstring: on folder descriptors, no link followed) -------------------

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        self._put_stream(key, iter((data,)), size=len(data), if_absent=if_absent)

    def _put_stream(
        self, key: str, chunks: Iterator[memoryview], *, size: int, if_absent: bool
    ) -> None:
        with os_errors("put", key, self.uri), self._write_dir(key) as (fd, name):
            tmp = self._write_temp(fd, chunks)
            try:
                if if_absent:
                    self._link_into_place(key, fd, tmp, name, AlreadyExistsError)
                else:
                    with self._key_lock(key):
                        self._replace_into_place(key, fd, tmp, name)
            finally:
                unlink_at(fd, tmp)
            self._sync_fd(fd)

    def _delete(self, key: str) -> None:
        *folders, name = key.split("/")
        with os_errors("delete", key, self.uri):
            try:
                fd = self._open_dir(folders)
            except OSError as e:
                if e.errno in ABSENT or e.errno == errno.ELOOP:
                    return  # nothing of the board's there (a link is not followed)
                raise
            try:
                try:
                    if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        return  # a folder of other keys, not an object
                    os.unlink(name, dir_fd=fd)  # a link itself, never what it points to
                except (FileNotFoundError, NotADirectoryError):
                    return
                self._sync_fd(fd)
            finally:
                os.close(fd)

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        with os_errors("cas", key, self.uri), self._key_lock(key):
            try:
                current: bytes | None = self._get(key)
            except NotAnObjectError as e:  # never replaced: say what is there
                raise StoreError(
                    f"cannot compare-and-swap: {e.message}", key=key, store=self.uri
                ) from None
            except NotFoundError:
                current = None
            if current != expected:
                raise cas_lost(key, self.uri, current)
            with self._write_dir(key) as (fd, name):
                tmp = self._write_temp(fd, iter((memoryview(data),)))
                try:
                    if expected is None:
                        self._link_into_place(key, fd, tmp, name, ConflictError)
                    else:
                        self._replace_into_place(key, fd, tmp, name)
                finally:
                    unlink_at(fd, tmp)
                self._sync_fd(fd)

    @contextlib.contextmanager
    def _write_dir(self, key: str) -> Iterator[tuple[int, str]]:
        """The key's folder (made where missing, each new folder's parent fsynced) as a
        descriptor reached from the root without following links, and the key's file name.
        A link, or a file, where a folder must be is refused (:func:`clash`, or a link)."""
        *folders, name = key.split("/")
        fd = self._open_dir([])
        try:
            for segment in folders:
                fd = enter_dir(fd, segment, key, self.uri, self._sync_fd)
            yield fd, name
        finally:
            os.close(fd)

    def _write_temp(self, fd: int, chunks: Iterator[memoryview]) -> str:
        tmp = f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
        try:
            for view in chunks:
                while view:
                    view = view[os.write(out, view) :]
            if self.fsync:
                os.fsync(out)
        except BaseException:
            os.close(out)
            unlink_at(fd, tmp)
            raise
        os.close(out)
        return tmp

    def _link_into_place(
        self, key: str, fd: int, tmp: str, name: str, exists_error: type[StoreError]
    ) -> None:
        try:  # linkat never follows the target's name: a link there is an existing name
            os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            if is_dir_at(fd, name):
                raise clash(key, self.uri) from None
            raise exists_error(
                "object exists and published objects are immutable", key=key, store=self.uri
            ) from None
        except OSError as e:
            if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise StoreError(
                    "the filesystem does not support hard links, which put-if-absent needs",
                    key=key,
                    store=self.uri,
                    hint="put the store on a POSIX filesystem (ext4, xfs, NFSv4)",
                ) from e
            raise

    def _replace_into_place(self, key: str, fd: int, tmp: str, name: str) -> None:
        if is_dir_at(fd, name):
            raise clash(key, self.uri)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)  # a link there is replaced itself

    def _sync_fd(self, fd: int) -> None:
        if self.fsync:
            os.fsync(fd)

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """Hold an exclusive flock on this key's lock file (kept: unlinking would race)."""
        name = hashlib.sha256(key.encode("utf-8")).hexdigest()[:40]
        with self._write_dir(f"{_LOCK_DIR}/{name}") as (folder, _):
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644, dir_fd=folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


def _is_key(key: str) -> bool:
    try:
        validate_key(key)
    except ValueError:
        return False
    return True
