"""A version the relay's watch holds back from long-polls because its manifest or step patch
failed prefetch (docs/relay.md, "Long-poll of LATEST"): its exception, and the one place it is
counted (``rollpatch_relay_unannounced_total{reason}``, a fixed set of reasons) and logged."""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import (
    ManifestError,
    NotFoundError,
    ObjectIntegrityError,
    RollpatchError,
    TransientStoreError,
)
from ..logs import event
from .metrics import Metrics

__all__ = ["REASONS", "Unannounced", "held_back", "reason_of"]

log = logging.getLogger("rollpatch.relay")

#: The ``reason`` label of ``rollpatch_relay_unannounced_total`` (:func:`reason_of`).
REASONS = ("corrupt", "refused", "missing", "timeout", "transient", "other")


class Unannounced(RollpatchError):
    """A version's manifest or step patch objects failed prefetch: it is not announced."""


def reason_of(err: BaseException) -> str:
    """Why a prefetch failed, as one of :data:`REASONS` (not the class name: a label stays a
    fixed, documented set)."""
    if isinstance(err, ObjectIntegrityError):
        return "corrupt"  # an object does not match the BLAKE3 in its key
    if isinstance(err, (ManifestError, ValueError)):
        return "refused"  # the manifest is invalid, or refused under the trust root
    if isinstance(err, NotFoundError):
        return "missing"
    if isinstance(err, (TimeoutError, FutureTimeout)):
        return "timeout"  # not fetched within the watch's prefetch timeout
    if isinstance(err, (TransientStoreError, OSError)):
        return "transient"
    return "other"


def held_back(
    metrics: Metrics, run: str, version: int, err: BaseException, *, first: bool
) -> Unannounced:
    """Count and log ``version`` of ``run`` held back for ``err`` (a WARNING the ``first``
    time for that version, DEBUG on each retry); the :class:`Unannounced` to raise."""
    reason = reason_of(err)
    metrics.inc("rollpatch_relay_unannounced_total", reason=reason)
    event(
        log,
        "unannounced",
        logging.WARNING if first else logging.DEBUG,
        run=run,
        version=version,
        reason=reason,
        error=f"{type(err).__name__}: {err}",
    )
    return Unannounced(
        "version not announced: its manifest or step patch failed prefetch",
        run=run,
        version=version,
        reason=reason,
    )
