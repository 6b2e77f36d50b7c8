"""botocore failures → the store's exception tree, for :class:`~rollpatch.store.s3.S3Store`.

Classes and status codes decide, never messages: 404 → NotFoundError, 412 → the caller's
precondition error (AlreadyExistsError for put-if-absent, ConflictError for cas), 409
ConditionalRequestConflict → the caller's conflict error, throttling/5xx/network →
TransientStoreError (after botocore's own retries), missing credentials → ConfigError.
"""

from __future__ import annotations

from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from ..errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)

__all__ = ["code_of", "status_of", "translate", "was_retried"]

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
    }
)
_NETWORK_ERRORS = (
    BotoConnectionError,
    HTTPClientError,
    ReadTimeoutError,
    IncompleteReadError,
    ResponseStreamingError,
)


def status_of(e: ClientError) -> int:
    """The HTTP status of a botocore ClientError (0 when it has none)."""
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def code_of(e: ClientError) -> str:
    """The S3 error code of a ClientError (empty when it has none)."""
    return str(e.response.get("Error", {}).get("Code") or "")


def was_retried(e: ClientError) -> bool:
    """Whether botocore retried the request (a condition may have met its own first try)."""
    return int(e.response.get("ResponseMetadata", {}).get("RetryAttempts") or 0) > 0


def translate(
    e: ClientError | BotoCoreError,
    op: str,
    key: str | None,
    uri: str,
    on_precondition: type[StoreError],
    on_conflict: type[StoreError],
) -> StoreError | ConfigError:
    """Map one botocore failure to the store's exception tree (classes, never messages)."""
    ctx: dict[str, Any] = {"key": key, "store": uri, "op": op}
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return ConfigError(
            f"no usable S3 credentials: {e}",
            hint="set ROLLPATCH_S3_ACCESS_KEY_ID and ROLLPATCH_S3_SECRET_ACCESS_KEY (or "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or an AWS profile); in Python, "
            "open_store(uri, access_key_id=..., secret_access_key=...); docs/store.md",
            **ctx,
        )
    if isinstance(e, _NETWORK_ERRORS):
        return TransientStoreError(f"S3 network failure: {e}", **ctx)
    if not isinstance(e, ClientError):
        return StoreError(f"S3 client failure: {e}", **ctx)
    status, code = status_of(e), code_of(e)
    if code == "NoSuchBucket":
        return StoreError("the bucket does not exist", hint="create it, or fix the URI", **ctx)
    if status == 404 and op in ("get", "list") and code not in ("NoSuchKey", "NotFound"):
        # S3 answers a missing key with NoSuchKey and lists an empty prefix with 200: a bare
        # 404 here is another HTTP server (a wrong endpoint URL or port), not an absent key
        return StoreError(
            f"the endpoint answered a bare 404 to an S3 {op}: it does not look like an S3 API",
            hint="check the endpoint URL and port (ROLLPATCH_S3_ENDPOINT_URL / endpoint_url)",
            **ctx,
        )
    if status == 404 or code in ("NoSuchKey", "NotFound"):
        return NotFoundError("no such object", **ctx)
    if status == 412 or code == "PreconditionFailed":
        if on_precondition is AlreadyExistsError:
            return AlreadyExistsError("object exists and published objects are immutable", **ctx)
        return on_precondition(
            f"S3 refused the conditional {op} (412)", **ctx, hint="re-read and retry"
        )
    if status == 409 and code == "ConditionalRequestConflict":
        return on_conflict(
            "a concurrent conditional write to this key was in flight (409)", hint="retry", **ctx
        )
    if status == 416 or code == "InvalidRange":
        return ConfigError("byte range is outside the object", **ctx)
    if status == 429 or status >= 500 or code in _TRANSIENT_CODES:
        return TransientStoreError(f"S3 {op} failed, retry later: {code} ({status})", **ctx)
    if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return StoreError(
            f"S3 denied {op}: {code}", hint="check credentials, region and bucket policy", **ctx
        )
    return StoreError(f"S3 {op} failed: {code} ({status})", **ctx)
