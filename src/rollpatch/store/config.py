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
from dataclasses import dataclass, fields
from typing import Any, Literal

from ..config import check_fields, setting
from ..errors import ConfigError

__all__ = ["ENV_VARS", "HttpConfig", "MiB", "S3Config", "http_config_from", "s3_config_from"]

MiB = 1024 * 1024
AddressingStyle = Literal["auto", "path", "virtual"]
Checksums = Literal["when_required", "when_supported"]
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

    bucket: str = setting(help="bucket name (the URI's host part)")
    #: Every store key lives below it.
    prefix: str = setting("", lo=0, help="key prefix inside the bucket, '' or ending in '/'")
    endpoint_url: str | None = setting(
        None, help="endpoint of an S3-compatible service (R2, MinIO...); None means AWS"
    )
    #: S3-compatible services usually accept ``us-east-1`` (R2: ``auto``).
    region: str | None = setting(None, help="signing region")
    access_key_id: str | None = setting(
        None, help="explicit credentials; None defers to boto3's default chain"
    )
    secret_access_key: str | None = setting(None, help="goes with access_key_id")
    session_token: str | None = setting(None, help="a temporary credential's session token")
    profile: str | None = setting(None, help="named profile from ~/.aws/config")
    addressing_style: AddressingStyle = setting(
        "auto", help="path (MinIO, loopback), virtual, or auto (path-style with an endpoint)"
    )
    multipart_threshold: int = setting(
        64 * MiB, lo=1, help="objects larger than this are uploaded in parts"
    )
    part_size: int = setting(
        64 * MiB,
        lo=_MIN_PART,
        hi=_MAX_PART,
        help="upload part size, and the chunk size of parallel ranged downloads",
    )
    max_workers: int = setting(
        8, lo=1, help="threads for parallel part uploads and ranged downloads"
    )
    connect_timeout: float = setting(
        10.0, lo=0.0, lo_open=True, help="seconds to establish a connection"
    )
    read_timeout: float = setting(60.0, lo=0.0, lo_open=True, help="seconds to wait for a read")
    max_attempts: int = setting(
        5,
        lo=1,
        help="total attempts per request (botocore standard retries: throttling, 5xx, network)",
    )
    #: rollpatch verifies digests end to end anyway.
    checksums: Checksums = setting(
        "when_required",
        help="botocore request_checksum_calculation; when_required keeps older "
        "S3-compatible services working",
    )

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise ConfigError("S3Config.bucket must be a bucket name", bucket=self.bucket)
        if self.prefix and (not self.prefix.endswith("/") or self.prefix.startswith("/")):
            raise ConfigError("S3Config.prefix must be '' or 'a/b/'", prefix=self.prefix)
        check_fields(self)
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                "S3Config.access_key_id and secret_access_key go together",
                hint="give both, or neither to use the default AWS chain",
            )


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """How the read-only relay client talks to ``http(s)://HOST[:PORT][/PREFIX]``."""

    timeout: float = setting(
        30.0, lo=0.0, lo_open=True, help="seconds per request (connect and each read)"
    )
    #: Reads are idempotent.
    retries: int = setting(3, lo=0, help="extra attempts after a network error, a 429 or a 5xx")
    backoff: float = setting(0.2, lo=0.0, help="first back-off in seconds; doubles each attempt")
    headers: Mapping[str, str] = setting(
        factory=dict,
        help="headers sent with every request (e.g. Authorization: Bearer ...)",
    )
    #: The client never trusts a peer's sizes.
    max_list_bytes: int = setting(64 * MiB, lo=1, help="cap on a list response body, in bytes")

    def __post_init__(self) -> None:
        check_fields(self)


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
