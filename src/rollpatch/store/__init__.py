"""The store: bytes by key, behind a narrow interface (see ``docs/store.md``).

>>> from rollpatch.store import open_store
>>> store = open_store("memory://doctest")
>>> store.put("runs/r1/LATEST", b"7")
>>> store.list("runs/")
['runs/r1/LATEST']

Backends: :class:`FileStore` (``file://``, the default), :class:`S3Store` (``s3://``, needs
boto3, imported on first use), :class:`HttpStore` (``http(s)://``, read-only relay client),
:class:`MemoryStore` (``memory://``, tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import MAX_KEY_BYTES, ObjectInfo, Store, validate_key, validate_prefix
from .config import HttpConfig, S3Config
from .file import FileStore
from .http_client import HttpStore
from .memory import MemoryStore
from .throttle import ThrottledStore
from .uri import open_reader_store, open_store

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = [
    "MAX_KEY_BYTES",
    "FileStore",
    "HttpConfig",
    "HttpStore",
    "MemoryStore",
    "ObjectInfo",
    "S3Config",
    "S3Store",
    "Store",
    "ThrottledStore",
    "open_reader_store",
    "open_store",
    "validate_key",
    "validate_prefix",
]


def __getattr__(name: str) -> Any:
    if name == "S3Store":  # imported lazily: boto3 is an optional extra
        from .s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
