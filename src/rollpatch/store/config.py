"""Options of the remote backends, and the one place where the store reads the environment.

Precedence, highest first: options passed to :func:`~rollpatch.store.open_store`, then
``ROLLPATCH_S3_*`` variables, then the standard AWS variables. Credentials that are not given
explicitly are left to boto3's default chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, config files, instance roles), so rollpatch never
re-implements or overrides that chain.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError
from ..validate import check_choice, check_int, check_number

__all__ = ["ENV_VARS", "HttpConfig", "MiB", "S3Config", "http_config_from", "s3_config_from"]

MiB = 1024 * 1024
_MIN_PART = 5 * MiB  # S3's minimum size of every part but the last
_MAX_PART = 5 * 1024 * MiB

#: Environment variables the store reads (all of them, here and nowhere else), by option.
ENV_VARS: dict[str, tuple[str, ...]] = {
    "endpoint_url": ("ROLLPATCH_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "region": ("ROLLPATCH_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"),
    "addressing_style": ("ROLLPATCH_S3_ADDRESSING_STYLE",),
    "access_key_id": ("ROLLPATCH_S3_ACCESS_KEY_ID",),
    "secret_access_key": ("ROLLPATCH_S3_SECRET_ACCESS_KEY",),
    "session_token": ("ROLLPATCH_S3_SESSION_TOKEN",),
}


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """How to reach one ``s3://BUCKET/PREFIX`` and how to move bytes to and from it."""

    #: Bucket name (the URI's host part).
    bucket: str
    #: Key prefix inside the bucket, ``""`` or ending in ``/``; every store key lives below it.
    prefix: str = ""
    #: Endpoint of an S3-compatible service (R2, MinIO...); ``None`` means AWS.
    endpoint_url: str | None = None
    #: Signing region; S3-compatible services usually accept ``us-east-1`` (R2: ``auto``).
    region: str | None = None
    #: Explicit credentials; ``None`` defers to boto3's default chain.
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    #: Named profile from ``~/.aws/config``.
    profile: str | None = None
    #: ``"path"`` (MinIO, loopback), ``"virtual"`` or ``"auto"`` (path-style with an endpoint).
    addressing_style: str = "auto"
    #: Objects larger than this are uploaded in parts.
    multipart_threshold: int = 64 * MiB
    #: Upload part size, and the chunk size of parallel ranged downloads.
    part_size: int = 64 * MiB
    #: Threads for parallel part uploads and ranged downloads.
    max_workers: int = 8
    #: Seconds to establish a connection / to wait for a read.
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    #: Total attempts per request (botocore "standard" retries: throttling, 5xx, network).
    max_attempts: int = 5
    #: botocore ``request_checksum_calculation``: ``"when_required"`` keeps older S3-compatible
    #: services working; rollpatch verifies digests end to end anyway.
    checksums: str = "when_required"

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise ConfigError("S3Config.bucket must be a bucket name", bucket=self.bucket)
        if self.prefix and (not self.prefix.endswith("/") or self.prefix.startswith("/")):
            raise ConfigError("S3Config.prefix must be '' or 'a/b/'", prefix=self.prefix)
        check_choice(
            "S3Config", "addressing_style", self.addressing_style, ("auto", "path", "virtual")
        )
        check_choice("S3Config", "checksums", self.checksums, ("when_required", "when_supported"))
        check_int("S3Config", "part_size", self.part_size, _MIN_PART, _MAX_PART)  # 5 MiB..5 GiB
        for name in ("multipart_threshold", "max_workers", "max_attempts"):
            check_int("S3Config", name, getattr(self, name), 1)
        for name in ("connect_timeout", "read_timeout"):
            check_number("S3Config", name, getattr(self, name), 0.0, lo_open=True)
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                "S3Config.access_key_id and secret_access_key go together",
                hint="give both, or neither to use the default AWS chain",
            )


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """How the read-only relay client talks to ``http(s)://HOST[:PORT][/PREFIX]``."""

    #: Seconds per request (connect and each read).
    timeout: float = 30.0
    #: Extra attempts after a network error, a 429 or a 5xx (reads are idempotent).
    retries: int = 3
    #: First back-off in seconds; doubles each attempt.
    backoff: float = 0.2
    #: Headers sent with every request (e.g. ``{"Authorization": "Bearer ..."}``).
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Cap on a list response body, in bytes (the client never trusts a peer's sizes).
    max_list_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        check_number("HttpConfig", "timeout", self.timeout, 0.0, lo_open=True)
        check_int("HttpConfig", "retries", self.retries, 0)
        check_number("HttpConfig", "backoff", self.backoff, 0.0)
        check_int("HttpConfig", "max_list_bytes", self.max_list_bytes, 1)


def _check_options(cls: type, options: Mapping[str, Any], reserved: tuple[str, ...]) -> None:
    allowed = {f.name for f in fields(cls)} - set(reserved)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown option(s) for {cls.__name__}: {', '.join(unknown)}",
            hint=f"allowed: {', '.join(sorted(allowed))}",
        )


def s3_config_from(
    bucket: str, prefix: str, options: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> S3Config:
    """Build an :class:`S3Config` from explicit ``options``, falling back to the environment.

    ``environ`` defaults to ``os.environ``; this is the only function in the store that reads it.
    """
    _check_options(S3Config, options, ("bucket", "prefix"))
    env = os.environ if environ is None else environ
    merged = dict(options)
    for name, variables in ENV_VARS.items():
        if merged.get(name) is not None:
            continue
        for var in variables:
            value = env.get(var)
            if value:  # an empty variable counts as unset, as in the AWS tools
                merged[name] = value
                break
    return S3Config(bucket=bucket, prefix=prefix, **merged)


def http_config_from(options: Mapping[str, Any]) -> HttpConfig:
    """Build an :class:`HttpConfig` from ``open_store`` options (the relay client reads no env)."""
    _check_options(HttpConfig, options, ())
    return HttpConfig(**options)
