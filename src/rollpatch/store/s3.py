"""``s3://BUCKET/PREFIX``: any S3-compatible object store (AWS S3, Cloudflare R2, MinIO).

boto3 is imported here and nowhere else (install the ``s3`` extra). Guarantees map onto S3's
own primitives, never onto read-then-write:

- put-if-absent: ``PutObject`` / ``CompleteMultipartUpload`` with ``If-None-Match: *``.
- cas: read the current content and its ETag, compare, then ``PutObject`` with
  ``If-Match: <etag>`` (or ``If-None-Match: *`` when the expectation is "absent").
- large objects: multipart upload from a small thread pool; reads start with one ranged GET and
  fetch the rest in parallel ranges pinned to the first response's ETag (``If-Match``), so a
  read never mixes two versions of an object.

botocore errors become the store's: 404 -> NotFoundError, 412 -> AlreadyExistsError (put) or
ConflictError (cas), throttling/5xx/network -> TransientStoreError (after botocore's retries).
Multipart uploads live in :mod:`.s3_multipart`, the error mapping in :mod:`.s3_errors`.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from ..errors import (
    AlreadyExistsError,
    ConfigError,
    ConflictError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from .base import ObjectInfo, Store, cas_lost, check_bounds, too_large, validate_key
from .config import S3Config
from .s3_errors import code_of, status_of, translate, was_retried
from .s3_multipart import put_multipart, put_stream

__all__ = ["S3Store"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class S3Store(Store):
    """A store under one bucket and key prefix; thread-safe (boto3 clients are)."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.uri = f"s3://{config.bucket}/{config.prefix}".rstrip("/")
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            aws_session_token=config.session_token,
            profile_name=config.profile,
        )
        style = config.addressing_style
        if style == "auto" and config.endpoint_url is not None:
            style = "path"  # custom endpoints rarely have wildcard DNS for virtual hosts
        self._client: Any = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region or "us-east-1",
            config=Config(
                connect_timeout=config.connect_timeout,
                read_timeout=config.read_timeout,
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                s3={"addressing_style": style},
                max_pool_connections=config.max_workers + 4,
                request_checksum_calculation=config.checksums,
                response_checksum_validation="when_required",
            ),
        )
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- plumbing -----------------------------------------------------------------------------

    def _k(self, key: str) -> str:
        return self.config.prefix + key

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.config.max_workers, thread_name_prefix="rollpatch-s3"
                )
            return self._pool

    def close(self) -> None:
        """Shut the thread pool and the connection pool down."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        close = getattr(self._client, "close", None)
        if close is not None:
            close()

    @contextlib.contextmanager
    def _calling(
        self,
        op: str,
        key: str | None,
        *,
        on_precondition: type[StoreError] = ConflictError,
        on_conflict: type[StoreError] = ConflictError,
    ) -> Iterator[None]:
        """Translate botocore failures raised inside the block into store errors."""
        try:
            yield
        except (ClientError, BotoCoreError) as e:
            raise translate(e, op, key, self.uri, on_precondition, on_conflict) from e

    # -- reads --------------------------------------------------------------------------------

    def _fetch(
        self, key: str, start: int, stop: int, etag: str | None = None
    ) -> tuple[bytes, int, str]:
        """GET bytes [start, stop); return (data, object size, etag). The data may end early
        when the object is shorter; callers check bounds against the size."""
        extra = {} if etag is None else {"IfMatch": etag}
        with self._calling("get", key, on_precondition=TransientStoreError):
            r = self._client.get_object(
                Bucket=self.config.bucket,
                Key=self._k(key),
                Range=f"bytes={start}-{stop - 1}",
                **extra,
            )
            body = r["Body"].read()
        match = _CONTENT_RANGE.fullmatch(r.get("ContentRange") or "")
        if match is None:  # a full 200 answer: the server ignored Range
            total, data = len(body), body[start:stop]
        else:
            total, data = int(match.group(3)), body
        if len(data) != max(0, min(stop, total) - start):
            raise TransientStoreError(
                "short read from S3", key=key, got=len(data), start=start, stop=stop, size=total
            )
        return data, total, r["ETag"]

    def _fetch_rest(self, key: str, start: int, end: int, etag: str) -> list[bytes]:
        """GET [start, end) in part-size ranges, in parallel, all pinned to ``etag``."""
        step = self.config.part_size
        bounds = [(a, min(a + step, end)) for a in range(start, end, step)]
        if len(bounds) == 1:
            return [self._fetch(key, start, end, etag)[0]]
        return list(self._executor().map(lambda b: self._fetch(key, b[0], b[1], etag)[0], bounds))

    def _get(self, key: str) -> bytes:
        return self._get_bounded(key, None)

    def _get_bounded(self, key: str, max_bytes: int | None) -> bytes:
        """The first part tells the object's size: over ``max_bytes``, nothing more is read."""
        try:
            first, total, etag = self._fetch(key, 0, self.config.part_size)
        except ConfigError:  # 416: S3 answers a ranged GET of an empty object this way
            with self._calling("get", key):
                return bytes(
                    self._client.get_object(Bucket=self.config.bucket, Key=self._k(key))[
                        "Body"
                    ].read()
                )
        if max_bytes is not None and total > max_bytes:
            raise too_large(key, self.uri, total, max_bytes)
        if total <= len(first):
            return first
        return b"".join([first, *self._fetch_rest(key, len(first), total, etag)])

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        stop = min(end, start + self.config.part_size)
        if start == end:
            info = self._head(key)
            if info is None:
                raise NotFoundError("no such object", key=key, store=self.uri)
            check_bounds(key, start, end, info.size)
            return b""
        try:
            first, total, etag = self._fetch(key, start, stop)
        except ConfigError:  # 416: start is at or past the end; report the real size
            info = self._head(key)
            if info is None:
                raise NotFoundError("no such object", key=key, store=self.uri) from None
            check_bounds(key, start, end, info.size)
            raise
        check_bounds(key, start, end, total)
        if stop == end:
            return first
        return b"".join([first, *self._fetch_rest(key, stop, end, etag)])

    def _head(self, key: str) -> ObjectInfo | None:
        try:
            with self._calling("head", key):
                r = self._client.head_object(Bucket=self.config.bucket, Key=self._k(key))
        except NotFoundError:
            return None
        modified = r.get("LastModified")
        return ObjectInfo(
            key=key,
            size=int(r["ContentLength"]),
            etag=r.get("ETag"),
            modified=modified.timestamp() if modified is not None else None,
        )

    def _list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        strip = len(self.config.prefix)
        with self._calling("list", None):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.config.bucket, Prefix=self.config.prefix + prefix
            )
            for page in pages:
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", ()))
        return sorted(k for k in keys if _is_key(k))

    # -- writes -------------------------------------------------------------------------------

    def _put(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        if len(data) > self.config.multipart_threshold:
            if if_absent and self._head(key) is not None:  # cheap early refusal; not the guard
                raise AlreadyExistsError(
                    "object exists and published objects are immutable", key=key, store=self.uri
                )
            self._put_multipart(key, data, if_absent=if_absent)
            return
        self._put_single(
            key, bytes(data), {"IfNoneMatch": "*"} if if_absent else {}, on_fail=AlreadyExistsError
        )

    def _put_single(
        self, key: str, body: bytes, condition: dict[str, str], *, on_fail: type[StoreError]
    ) -> None:
        """One conditional PutObject; 412 -> ``on_fail`` unless our own retried write won."""
        with self._calling(
            "put",
            key,
            on_precondition=on_fail,
            on_conflict=TransientStoreError if on_fail is AlreadyExistsError else ConflictError,
        ):
            try:
                self._client.put_object(
                    Bucket=self.config.bucket, Key=self._k(key), Body=body, **condition
                )
            except ClientError as e:
                # A retried request can hit the condition its own first attempt satisfied.
                if (
                    condition
                    and status_of(e) in (404, 412)
                    and was_retried(e)
                    and self._holds(key, body)
                ):
                    return
                raise

    def _holds(self, key: str, body: bytes) -> bool:
        try:
            return self._get(key) == body
        except StoreError:
            return False

    def _put_multipart(self, key: str, data: memoryview, *, if_absent: bool) -> None:
        put_multipart(self, key, data, if_absent=if_absent)

    def _put_stream(
        self, key: str, chunks: Iterator[memoryview], *, size: int, if_absent: bool
    ) -> None:
        """Multipart upload fed part by part: at most ``max_workers + 1`` parts in memory."""
        if size <= self.config.multipart_threshold:
            super()._put_stream(key, chunks, size=size, if_absent=if_absent)
            return
        put_stream(self, key, chunks, size=size, if_absent=if_absent)

    def _delete(self, key: str) -> None:
        try:
            with self._calling("delete", key):
                self._client.delete_object(Bucket=self.config.bucket, Key=self._k(key))
        except NotFoundError:  # some S3-compatible services answer 404; AWS answers 204
            pass

    def _cas(self, key: str, data: bytes, *, expected: bytes | None) -> None:
        if len(data) > self.config.multipart_threshold:
            raise ConfigError(
                "cas is for small pointer objects",
                key=key,
                size=len(data),
                multipart_threshold=self.config.multipart_threshold,
            )
        if expected is None:
            condition = {"IfNoneMatch": "*"}
        else:
            with self._calling("get", key):
                try:
                    r = self._client.get_object(Bucket=self.config.bucket, Key=self._k(key))
                except ClientError as e:
                    if status_of(e) == 404 and code_of(e) != "NoSuchBucket":
                        raise ConflictError(
                            "compare-and-swap lost: the key is absent",
                            key=key,
                            store=self.uri,
                            absent=True,
                            hint="re-read the pointer and retry",
                        ) from None
                    raise
                current = r["Body"].read()
            if current != expected:
                raise cas_lost(key, self.uri, current)
            condition = {"IfMatch": r["ETag"]}
        try:
            self._put_single(key, data, condition, on_fail=ConflictError)
        except NotFoundError:  # If-Match on a key deleted meanwhile
            raise ConflictError(
                "compare-and-swap lost: the key was deleted", key=key, store=self.uri, absent=True
            ) from None


def _is_key(key: str) -> bool:
    try:
        validate_key(key)
    except ValueError:
        return False
    return True
