"""``open_store``: from a URI string to a :class:`~rollpatch.store.base.Store`.

URIs stay strings everywhere else in rollpatch; this is the one place that parses them.
Remote backends are imported only when their scheme is used, so ``import rollpatch`` needs
neither boto3 nor a network.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from ..errors import ConfigError
from .base import Store, validate_key

__all__ = ["SCHEMES", "file_path", "open_reader_store", "open_store"]

#: The URI schemes ``open_store`` understands (a plain path means ``file``).
SCHEMES = ("file", "s3", "http", "https", "memory")


def open_store(uri: str, **options: Any) -> Store:
    """Open the store named by ``uri``.

    - ``/abs/dir``, ``rel/dir`` or ``file:///abs/dir``: :class:`FileStore`; option ``fsync``.
    - ``s3://BUCKET[/PREFIX]``: :class:`S3Store`; options are :class:`S3Config` fields
      (endpoint_url, region, credentials, part sizes, timeouts, retries); the rest comes from
      ``ROLLPATCH_S3_*`` and the standard AWS environment variables.
    - ``http(s)://HOST[:PORT][/PREFIX]``: read-only :class:`HttpStore` of a relay; options are
      :class:`HttpConfig` fields.
    - ``memory://NAME``: process-local :class:`MemoryStore` (tests); no options.

    Raises :class:`ConfigError` for an unknown scheme, a malformed URI or an unknown option.
    """
    if not isinstance(uri, str) or not uri:
        raise ConfigError("store URI must be a non-empty string", uri=uri)
    scheme, sep, _ = uri.partition("://")
    if not sep:
        return _open_file(uri, options)
    scheme = scheme.lower()
    if scheme == "file":
        parts = urllib.parse.urlsplit(uri)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ConfigError("file URI must be file:///absolute/path", uri=uri)
        return _open_file(file_path(uri) or "", options)
    if scheme == "memory":
        return _open_memory(uri, options)
    if scheme == "s3":
        return _open_s3(uri, options)
    if scheme in ("http", "https"):
        from .config import http_config_from
        from .http_client import HttpStore

        return HttpStore(uri, http_config_from(options))
    raise ConfigError(
        f"unknown store scheme {scheme!r}",
        uri=uri,
        hint=f"use one of {', '.join(s + '://' for s in SCHEMES)} or a path",
    )


def open_reader_store(uri: str, **options: Any) -> Store:
    """:func:`open_store` for a reader that retries on its own (a follower, ``pull``, a
    sidecar: their ``retries`` and ``backoff_s``): a relay's or S3's client makes one attempt
    per request unless ``options`` say otherwise, so a follower's ``retries=N`` is N + 1
    requests per read, not (N + 1) x the client's 4 (and its backoff the only one).
    Directory and memory stores have no retries of their own."""
    scheme = uri.partition("://")[0].lower() if isinstance(uri, str) and "://" in uri else ""
    if scheme in ("http", "https"):
        options.setdefault("retries", 0)
    elif scheme == "s3":
        options.setdefault("max_attempts", 1)
    return open_store(uri, **options)


def file_path(uri: str) -> str | None:
    """The directory a plain path or ``file://`` URI names, as :func:`open_store` opens it
    (percent-escapes decoded); None for another scheme."""
    scheme, sep, _ = uri.partition("://")
    if not sep:
        return uri
    if scheme.lower() != "file":
        return None
    return urllib.parse.unquote(urllib.parse.urlsplit(uri).path)


def _open_file(path: str, options: dict[str, Any]) -> Store:
    from .file import FileStore

    unknown = sorted(set(options) - {"fsync"})
    if unknown:
        raise ConfigError(
            f"unknown option(s) for file stores: {', '.join(unknown)}", hint="allowed: fsync"
        )
    return FileStore(path, **options)


def _open_memory(uri: str, options: dict[str, Any]) -> Store:
    from .memory import MemoryStore

    if options:
        raise ConfigError("memory stores take no options", options=sorted(options))
    name = uri.partition("://")[2]
    if not name or "/" in name:
        raise ConfigError("memory URI must be memory://NAME", uri=uri)
    return MemoryStore(name)


def _open_s3(uri: str, options: dict[str, Any]) -> Store:
    from .config import s3_config_from

    rest = uri.partition("://")[2]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if prefix:
        try:
            validate_key(prefix)
        except ConfigError:
            raise ConfigError("s3 URI prefix must be a valid key path", uri=uri) from None
        prefix += "/"
    config = s3_config_from(bucket, prefix, options)  # validates before boto3 is needed
    try:
        from .s3 import S3Store
    except ImportError as e:
        raise ConfigError(
            f"s3:// stores need boto3 ({e})", hint="pip install 'rollpatch[s3]'"
        ) from None
    return S3Store(config)
