"""Multipart uploads for :class:`~rollpatch.store.s3.S3Store` (objects over
``multipart_threshold``).

Parts go up from the store's small thread pool; the upload completes with ``If-None-Match: *``
when the object must not exist yet (the guard of put-if-absent, checked by S3 itself), and any
failure, including an interrupt, aborts the upload so no parts are left billed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from ..errors import AlreadyExistsError, ConfigError, TransientStoreError

if TYPE_CHECKING:
    from .s3 import S3Store

__all__ = ["MAX_PARTS", "check_parts", "put_multipart", "put_stream"]

#: S3's limit on the parts of one upload.
MAX_PARTS = 10_000


def check_parts(key: str, size: int, part_size: int) -> None:
    """ConfigError when ``size`` bytes need more than :data:`MAX_PARTS` parts."""
    if -(-size // part_size) > MAX_PARTS:
        raise ConfigError(
            "object needs more than 10000 parts",
            key=key,
            size=size,
            part_size=part_size,
            hint="raise part_size",
        )


class _Upload:
    """One multipart upload of ``key`` (created on construction)."""

    def __init__(self, store: S3Store, key: str) -> None:
        self.store, self.key = store, key
        self.bucket, self.k = store.config.bucket, store._k(key)
        with store._calling("put", key):
            self.upload_id = store._client.create_multipart_upload(Bucket=self.bucket, Key=self.k)[
                "UploadId"
            ]

    def part(self, i: int, body: bytes) -> dict[str, Any]:
        """Upload part ``i`` (from 0)."""
        with self.store._calling("put", self.key):
            r = self.store._client.upload_part(
                Bucket=self.bucket, Key=self.k, UploadId=self.upload_id, PartNumber=i + 1, Body=body
            )
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    def complete(self, parts: list[dict[str, Any]], *, if_absent: bool) -> None:
        with self.store._calling(
            "put", self.key, on_precondition=AlreadyExistsError, on_conflict=TransientStoreError
        ):
            self.store._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=self.k,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
                **({"IfNoneMatch": "*"} if if_absent else {}),
            )

    def abort(self) -> None:
        with contextlib.suppress(ClientError, BotoCoreError):
            self.store._client.abort_multipart_upload(
                Bucket=self.bucket, Key=self.k, UploadId=self.upload_id
            )


def put_multipart(store: S3Store, key: str, data: memoryview, *, if_absent: bool) -> None:
    """Upload ``data`` in ``part_size`` parts, in parallel."""
    size = store.config.part_size
    check_parts(key, len(data), size)
    up = _Upload(store, key)
    try:
        count = -(-len(data) // size)
        parts = list(
            store._executor().map(
                lambda i: up.part(i, bytes(data[i * size : (i + 1) * size])), range(count)
            )
        )
        up.complete(parts, if_absent=if_absent)
    except BaseException:
        up.abort()
        raise


def put_stream(
    store: S3Store, key: str, chunks: Iterator[memoryview], *, size: int, if_absent: bool
) -> None:
    """Upload ``size`` bytes fed as ``chunks``: at most ``max_workers + 1`` parts in memory."""
    part = store.config.part_size
    check_parts(key, size, part)
    if if_absent and store._head(key) is not None:  # cheap early refusal; not the guard
        raise AlreadyExistsError(
            "object exists and published objects are immutable", key=key, store=store.uri
        )
    up = _Upload(store, key)
    pending: list[Future[dict[str, Any]]] = []
    parts: list[dict[str, Any]] = []

    def submit(body: bytes) -> None:
        pending.append(store._executor().submit(up.part, len(parts) + len(pending), body))
        while len(pending) > store.config.max_workers:
            parts.append(pending.pop(0).result())

    try:
        buf = bytearray()
        for c in chunks:
            off = 0
            while off < len(c):
                take = c[off : off + part - len(buf)]
                buf += take
                off += len(take)
                if len(buf) == part:
                    submit(bytes(buf))
                    buf = bytearray()
        if buf:
            submit(bytes(buf))
        parts += [f.result() for f in pending]
        up.complete(parts, if_absent=if_absent)
    except BaseException:
        for f in pending:
            f.cancel()
        up.abort()
        raise
