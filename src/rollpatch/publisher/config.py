"""Publisher configuration and statistics: plain data, validated, no I/O."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Literal

from ..config import check_fields, setting
from ..errors import ConfigError
from ..formats import FORMAT_NAMES, QuantPolicy
from ..formats.base import SCALE_MODES
from ..trust import Signer

__all__ = [
    "DiffOn",
    "Guard",
    "NamesMode",
    "PublisherConfig",
    "PublisherStats",
    "VersionStats",
    "default_publisher_id",
]

#: Where a publisher's O(N) work runs (see ``PublisherConfig.diff_on``).
DiffOn = Literal["host", "device", "auto"]
#: What ``publish()`` copies on the host path (see ``PublisherConfig.snapshot``).
SnapshotMode = Literal["served", "masters"]
#: Whether a guard (docs/publisher.md, *Guards*) fails the version or lets it through.
Guard = Literal["refuse", "allow"]
#: The names a state dict is published under (see ``PublisherConfig.names``).
NamesMode = Literal["unwrap", "as_given"]

#: Per-version statistics kept in memory (the oldest are forgotten first).
MAX_STATS = 10_000


def default_publisher_id() -> str:
    """``hostname:pid`` — what manifests record as their publisher by default."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """How a :class:`~rollpatch.publisher.Publisher` turns master weights into versions."""

    format: str = setting("bf16", choices=FORMAT_NAMES, help="served format (fixed per run)")
    scales: str = setting(
        "bf16",
        choices=SCALE_MODES,
        help="where quantisation scales come from: bf16, fp32 or frozen (docs/formats.md)",
    )
    policy: QuantPolicy | None = setting(
        None, help="which tensors a quantised format quantises (None: the default QuantPolicy)"
    )
    keyframe_every: int = setting(
        50,
        lo=0,
        metavar="K",
        help="keyframe when the version crosses a multiple of K (0: first only)",
    )
    skip_strides: tuple[int, ...] = setting(
        (8,),
        help="for each stride s, version n with n % s == 0 also gets a patch from n - s",
    )
    """For each stride ``s``, version ``n`` with ``n % s == 0`` also gets a patch from version
    ``n - s`` (when this publisher published ``n - s`` and every version between them, so
    lagging followers catch up in one hop). Empty: step patches only. With ``fold_every=F``
    the fold gives version ``n`` a patch from ``n - F`` whenever ``n % F == 0`` and no
    keyframe boundary lies between them: ``skip_strides=()`` then costs the trainer about
    what the default ``(8,)`` costs without folds (docs/publisher.md, *Folded patches*)."""
    fold_every: int = setting(
        0,
        lo=0,
        metavar="F",
        help="every version also gets one patch from its anchor: the last multiple of F "
        "(or of keyframe_every) below it (0: off)",
    )
    """Folded patches from anchors (docs/publisher.md, *Folded patches*): version ``n`` also gets
    one patch from its anchor ``a``, the largest version below ``n`` that is a multiple of
    ``fold_every`` or of ``keyframe_every``, when ``n - a >= 2`` and this publisher published
    ``a`` and every version since (``encode(diff(view a, view n), view a)``). A follower at an anchor — a replica booted from a keyframe, one that stopped at a
    multiple of F — then catches up by one patch for any lag up to F. Costs (host path): the
    anchor's served view held (one more view of this rank's shard), one more fused encode
    per version (with ``skip_strides=()``, about the trainer CPU of the default skip stride
    without folds), and the folded patch's bytes (2.9x the step patches' at 103M, F = 8).
    The device path composes the fold in a host accumulator (O(change since the anchor)).
    Off (0) by default for that memory; 8 for fleets with elastic joins or lagging replicas
    (docs/publisher.md, *Folded patches*)."""
    max_pending: int = setting(
        1, lo=1, help="snapshots allowed to wait behind the one being published"
    )
    """When a new snapshot arrives and the queue is full, the oldest waiting one is dropped (its
    version is never published)."""
    outage_s: float | None = setting(
        3600.0,
        lo=0,
        metavar="S",
        none="never stop",
        help="ride out a store outage this long before stopping (0: stop at the first failure)",
    )
    """A store that stops answering (after its client's own retries) does not stop an
    unsharded publisher: it keeps the version, retries (0.5 s doubling to 30 s) and resumes
    from the board's LATEST once the store answers, while ``publish()`` goes on accepting
    (and coalescing) versions; only after ``outage_s`` seconds of failures does it stop with
    the store's error (None: never). Sharded publishers stop at once (docs/publisher.md,
    *Errors*)."""
    takeover: bool = setting(
        False,
        help="take the run from the publisher holding it (that one stops before its next version)",
    )
    """One publisher per run (docs/publisher.md, *One publisher per run*): a publisher starting
    on a run another live publisher holds is refused (``ConfigError``), unless ``takeover``."""
    publisher_id: str = setting(
        factory=default_publisher_id,
        hi=256,
        help="recorded in each manifest (default hostname:pid)",
    )
    signer: Signer | None = setting(
        None, help="signs every manifest and LATEST with its Ed25519 keys (docs/trust.md)"
    )
    """LATEST is valid for ``signer.latest_ttl_s``, and resuming refuses manifests that none of
    its keys signed."""
    diff_on: DiffOn = setting(
        "host", help="where the O(N) work runs: host, device or auto (docs/publisher.md)"
    )
    """Where the O(N) work runs. ``host``: masters are copied to host memory in ``publish()``
    and cast, compared and hashed there with numpy and the native core. ``device``: they are
    copied on their own torch device, the previous served view stays there, and the cast
    (BF16 in torch; other kinds on the host, tensor by tensor), compare, coder records and
    digests run there; only O(changed) bytes reach the host (needs torch and the native
    core; the same bytes on the board). ``auto``: ``device`` when the first published state
    dict holds a torch tensor off the CPU, else ``host``."""
    snapshot: SnapshotMode = setting(
        "served", help="host path: what publish() copies: the served view or the masters"
    )
    """Host path: what ``publish()`` keeps of the state dict. ``served``: it casts tensor by
    tensor into the served view (BF16: half the FP32 masters; the cast is then part of
    ``snapshot_s``, not ``cast_s``), so the publisher's host memory is about one served view
    beyond the previous one. ``masters``: it copies the masters as they are (FP32: twice a
    BF16 view) and the worker casts them (``publish()`` returns sooner). ``scales="frozen"``
    always copies the masters (its cast reads the previous view)."""
    names: NamesMode = setting(
        "unwrap", help="unwrap: drop a wrapper prefix on every name and tied aliases; as_given"
    )
    """``unwrap``: the names an engine loads. A prefix every name shares that a wrapper puts
    there (``torch.compile``'s ``_orig_mod.``, DDP's ``module.``) is taken off, and a tensor
    that shares its memory with an earlier one (a tied ``lm_head.weight``) is published once,
    under the first name, as engines hold it; the first ``publish()`` logs what it did.
    ``as_given``: every name as the state dict has it (docs/publisher.md, *Guards*)."""
    nonfinite: Guard = setting(
        "refuse", help="refuse: a served NaN or +-inf fails the version (a diverged step); allow"
    )
    """``refuse``: a version whose served tensors hold a NaN or ±inf fails (the publisher
    then raises it, as any failed version; the board and LATEST are untouched). Quantised
    formats refuse NaN in any case. ``allow``: BF16/FP16/FP32 keep them."""
    model_changes: Guard = setting(
        "refuse", help="refuse: a version adding, dropping or reshaping tensors fails; allow"
    )
    """``refuse``: a version that adds, drops, reshapes or retypes a tensor of the version
    before it (a resumed run included) fails before anything is written: engines started
    with the run's model cannot load it, and LATEST never moves back. ``allow``: published
    (with a WARNING); engines keep serving the version they hold (docs/follower.md)."""

    def __post_init__(self) -> None:
        check_fields(self)
        strides = self.skip_strides
        if isinstance(strides, (str, bytes)) or not all(_is_int(s) and s >= 2 for s in strides):
            raise ConfigError(
                "PublisherConfig.skip_strides must be a tuple of ints >= 2",
                field="skip_strides",
                value=strides,
                hint="e.g. skip_strides=(8, 64)",
            )
        object.__setattr__(self, "skip_strides", tuple(sorted(set(strides))))
        if self.fold_every == 1:
            raise ConfigError(
                "PublisherConfig.fold_every must be 0 (off) or >= 2",
                field="fold_every",
                value=self.fold_every,
                hint="every version already gets a patch from its parent",
            )

    def is_anchor(self, version: int) -> bool:
        """Whether folded patches start at ``version`` (``fold_every``)."""
        f, k = self.fold_every, self.keyframe_every
        return f > 0 and (version % f == 0 or (k > 0 and version % k == 0))

    def anchor_below(self, version: int) -> int:
        """The anchor a version's folded patch starts from: the largest anchor below it
        (``fold_every`` > 0, ``version`` >= 1)."""
        f, k = self.fold_every, self.keyframe_every
        a = (version - 1) // f * f
        return max(a, (version - 1) // k * k) if k > 0 else a

    def shared_settings(self) -> dict[str, object]:
        """The settings every rank of a sharded publisher must share, as JSON values: they
        decide the served bytes, the keyframes and the patch set rank 0 lists in one manifest.
        Per-rank ones (``publisher_id``, ``diff_on``, ``snapshot``, ``max_pending``,
        ``outage_s``, ``takeover``: rank 0's lease, ``signer``: rank 0 signs) are not here."""
        policy = self.policy if self.policy is not None else QuantPolicy()
        return {
            "format": self.format,
            "scales": self.scales,
            "policy": repr(policy),
            "keyframe_every": self.keyframe_every,
            "skip_strides": list(self.skip_strides),
            "fold_every": self.fold_every,
            "names": self.names,
            "nonfinite": self.nonfinite,
            "model_changes": self.model_changes,
        }

    @property
    def window(self) -> int:
        """How far back any patch's base lies from its version (skip strides, folds)."""
        return max(1, self.fold_every, *self.skip_strides)


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
    tensors_dropped: int = 0
    """Tensors of the parent version the step drops (the trainer no longer has them)."""
    tensors_whole: int = 0
    """Tensors the step ships whole: added, or reshaped or retyped since the parent."""


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
    outages: int = 0
    """Store outages ridden out (``outage_s``): the store failed, then answered again and a
    version became durable."""
    outage_since_s: float | None = None
    """Seconds since the current store outage began (None: the store answers)."""
