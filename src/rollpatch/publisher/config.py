"""Publisher configuration and statistics: plain data, validated, no I/O."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from ..formats import QuantPolicy, get_format
from ..formats.base import SCALE_MODES
from ..trust import Signer

__all__ = ["DiffOn", "PublisherConfig", "PublisherStats", "VersionStats", "default_publisher_id"]

#: Where a publisher's O(N) work runs (see ``PublisherConfig.diff_on``).
DiffOn = Literal["host", "device", "auto"]
DIFF_ON: tuple[str, ...] = ("host", "device", "auto")
#: What ``publish()`` copies on the host path (see ``PublisherConfig.snapshot``).
SnapshotMode = Literal["served", "masters"]
SNAPSHOT_MODES: tuple[str, ...] = ("served", "masters")

#: Per-version statistics kept in memory (the oldest are forgotten first).
MAX_STATS = 10_000


def default_publisher_id() -> str:
    """``hostname:pid`` — what manifests record as their publisher by default."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """How a :class:`~rollpatch.publisher.Publisher` turns master weights into versions."""

    format: str = "bf16"
    """Served format (a CLI name from :data:`rollpatch.formats.FORMAT_NAMES`); fixed per run."""
    scales: str = "bf16"
    """Scale mode of quantised formats: ``bf16``, ``fp32`` or ``frozen`` (docs/formats.md)."""
    policy: QuantPolicy | None = None
    """Which tensors a quantised format quantises (None: the default :class:`QuantPolicy`)."""
    keyframe_every: int = 50
    """A keyframe (full view) at the run's first version and whenever the version number
    crosses a multiple of this (every K versions; 0 = only the first version)."""
    skip_strides: tuple[int, ...] = (8,)
    """For each stride ``s``, version ``n`` with ``n % s == 0`` also gets a patch from version
    ``n - s`` (when this publisher published ``n - s`` and every version between them, so
    lagging followers catch up in one hop). Empty: step patches only."""
    max_pending: int = 1
    """Snapshots allowed to wait behind the one being published; when a new one arrives and the
    queue is full, the oldest waiting one is dropped (its version is never published)."""
    publisher_id: str = field(default_factory=default_publisher_id)
    """Recorded in each manifest (at most 256 characters)."""
    signer: Signer | None = None
    """When set, every manifest and LATEST is signed with its Ed25519 keys (LATEST valid for
    ``signer.latest_ttl_s``), and resuming refuses manifests that none of its keys signed
    (docs/trust.md)."""
    diff_on: DiffOn = "host"
    """Where the O(N) work runs. ``host``: masters are copied to host memory in ``publish()``
    and cast, compared and hashed there with numpy and the native core. ``device``: they are
    copied on their own torch device, the previous served view stays there, and the cast
    (BF16 in torch; other kinds on the host, tensor by tensor), compare, coder records and
    digests run there; only O(changed) bytes reach the host (needs torch and the native
    core; the same bytes on the board). ``auto``: ``device`` when the first published state
    dict holds a torch tensor off the CPU, else ``host``."""
    snapshot: SnapshotMode = "served"
    """Host path: what ``publish()`` keeps of the state dict. ``served``: it casts tensor by
    tensor into the served view (BF16: half the FP32 masters; the cast is then part of
    ``snapshot_s``, not ``cast_s``), so the publisher's host memory is about one served view
    beyond the previous one. ``masters``: it copies the masters as they are (FP32: twice a
    BF16 view) and the worker casts them (``publish()`` returns sooner). ``scales="frozen"``
    always copies the masters (its cast reads the previous view)."""

    def __post_init__(self) -> None:
        try:
            get_format(self.format)
        except ConfigError as e:
            raise ConfigError(f"PublisherConfig.format: {e.message}", hint=e.hint) from None
        if self.scales not in SCALE_MODES:
            raise ConfigError(
                f"PublisherConfig.scales must be one of {', '.join(SCALE_MODES)}", value=self.scales
            )
        if self.policy is not None and not isinstance(self.policy, QuantPolicy):
            raise ConfigError(
                "PublisherConfig.policy must be a QuantPolicy or None",
                value=type(self.policy).__name__,
            )
        if not _is_int(self.keyframe_every) or self.keyframe_every < 0:
            raise ConfigError(
                "PublisherConfig.keyframe_every must be an int >= 0", value=self.keyframe_every
            )
        strides = self.skip_strides
        if isinstance(strides, (str, bytes)) or not all(_is_int(s) and s >= 2 for s in strides):
            raise ConfigError(
                "PublisherConfig.skip_strides must be a tuple of ints >= 2",
                value=strides,
                hint="e.g. skip_strides=(8, 64)",
            )
        object.__setattr__(self, "skip_strides", tuple(sorted(set(strides))))
        if not _is_int(self.max_pending) or self.max_pending < 1:
            raise ConfigError(
                "PublisherConfig.max_pending must be an int >= 1", value=self.max_pending
            )
        if not isinstance(self.publisher_id, str) or not 0 < len(self.publisher_id) <= 256:
            raise ConfigError(
                "PublisherConfig.publisher_id must be 1-256 characters", value=self.publisher_id
            )
        if self.diff_on not in DIFF_ON:
            raise ConfigError(
                f"PublisherConfig.diff_on must be one of {', '.join(DIFF_ON)}", value=self.diff_on
            )
        if self.snapshot not in SNAPSHOT_MODES:
            raise ConfigError(
                f"PublisherConfig.snapshot must be one of {', '.join(SNAPSHOT_MODES)}",
                value=self.snapshot,
            )
        if self.signer is not None and not isinstance(self.signer, Signer):
            raise ConfigError(
                "PublisherConfig.signer must be a rollpatch.trust.Signer or None",
                field="signer",
                hint="Signer.from_files(['publisher.key'])",
            )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class VersionStats:
    """What publishing one version cost (seconds and bytes; this rank's share when sharded)."""

    version: int
    parent: int | None
    keyframe: bool
    skip_bases: tuple[int, ...]
    snapshot_s: float
    """Copying the state dict to host memory, inside ``publish()``."""
    call_return_s: float
    """How long ``publish()`` blocked the caller (snapshot + enqueue, or everything if sync)."""
    queue_s: float
    """Waiting behind earlier versions."""
    resume_s: float
    """Rebuilding the previous view from the board (first version after a resume only)."""
    cast_s: float
    diff_s: float
    encode_s: float
    """Encoding step and skip patches, composing skip patches, serialising keyframes."""
    upload_s: float
    """Putting this rank's objects."""
    commit_s: float
    """Exchanging with the other ranks, the manifest and advancing LATEST."""
    total_s: float
    """From ``publish()`` being called to LATEST naming the version."""
    bytes: int
    """Bytes of objects this rank uploaded for the version."""
    patch_bytes: int
    """Bytes of the step patch (this rank's shard); 0 for a run's first version."""
    changed: int
    """Served elements the step changed (this rank's shard)."""
    host_bytes: int = 0
    """``diff_on="device"``: bytes of change records (and new tensors) copied from the device
    to the host for the step patch; 0 on the host path."""


@dataclass(frozen=True)
class PublisherStats:
    """A snapshot of a publisher's statistics."""

    versions: tuple[VersionStats, ...]
    """The most recent published versions (at most 10,000), oldest first."""
    bytes_uploaded: int
    """All object bytes this publisher (this rank) uploaded."""
    dropped: tuple[int, ...]
    """Version numbers accepted but never published (coalesced away; the most recent 10,000),
    ascending."""
    n_dropped: int
    """How many versions were dropped in all."""
    published: int
    """How many versions this publisher made durable."""
