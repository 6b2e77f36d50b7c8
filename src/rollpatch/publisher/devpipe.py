"""The device path of one rank's publishing (``PublisherConfig(diff_on="device")``).

:class:`DeviceShardPipeline` is a :class:`ShardPipeline` whose previous view stays on the
device of the master weights (:class:`DeviceView`): the cast (BF16 in torch; other served
kinds fall back to the numpy formats on the host, tensor by tensor, and are copied back to
the device), the compare, the coder's records and the tensor digests run there
(``publisher.device``), and the host receives only O(changed) arrays, from which it codes the
same patch bytes as the host path. A keyframe, when due, is copied to the host tensor by
tensor and serialised; nothing else of the view is kept on the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .. import native
from ..errors import BoardError, ConfigError, FormatError, PatchError
from ..formats import get_format
from ..io import view_to_bytes
from ..io.checkpoint import to_numpy
from ..kinds import KINDS
from ..patch import DeltaOp, DropOp, FullOp, Patch, TensorPatch, wire
from ..patch.codec_v2 import CtxGolombV2
from ..patch.codecs import XorZstd, encode_full
from ..view import Tensor, View, root_digest
from .device import (
    DeviceTensor,
    TensorRecords,
    bf16_words,
    from_host,
    records,
    scatter_elements,
    sum128_state,
    sum128_update,
)
from .guards import check_finite, check_same_model
from .pipeline import ShardPipeline, _lap
from .result import ShardResult
from .snapshot import check_dtype

__all__ = ["DeviceShardPipeline", "DeviceView", "snapshot_device"]


class DeviceView(Mapping[str, DeviceTensor]):
    """A served view whose words live on torch devices; digests from the tensors' states."""

    def __init__(self, tensors: Mapping[str, DeviceTensor], metadata: Mapping[str, str]) -> None:
        self._tensors = dict(tensors)
        self.metadata = dict(metadata)

    def __getitem__(self, name: str) -> DeviceTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def tensor_digests(self) -> dict[str, str]:
        return {name: t.digest() for name, t in self._tensors.items()}

    def digest(self) -> str:
        return root_digest(self.tensor_digests())

    def host(self) -> View:
        """The view on the host (copied tensor by tensor off a GPU; shared on the CPU)."""
        return View({n: t.host() for n, t in self._tensors.items()}, self.metadata)


def snapshot_device(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Copies of every master on its own device (numpy arrays become CPU tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise ConfigError("state dict keys must be tensor names (str)", key=repr(name))
        if isinstance(value, torch.Tensor):
            t = value.detach().clone(memory_format=torch.contiguous_format)
        else:
            arr = to_numpy(value)
            if arr.dtype.name == "bfloat16":
                t = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
            else:
                t = torch.from_numpy(np.array(arr, copy=True, order="C"))
        check_dtype(name, str(t.dtype).removeprefix("torch."))
        out[name] = t
    return out


class DeviceShardPipeline(ShardPipeline):
    """:class:`ShardPipeline` with the previous view on the device (module docstring)."""

    FOLD_BY_ACCUMULATOR = True  # no anchor view held on the device: the fold is composed

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        native.require()  # records are coded by the native core
        self._host_bytes = 0
        self._code_s = 0.0

    def build(self, version: int, masters: Mapping[str, Any], *, keyframe: bool) -> ShardResult:
        t = time.perf_counter()
        view = self._cast(masters)
        if self.config.nonfinite == "refuse":
            check_finite(view, run=self.run, version=version)
        if self.config.model_changes == "refuse":
            check_same_model(self.prev, view, run=self.run, version=version, whole=self._whole_prev)
        res = ShardResult(version, view)
        res.resumed = self.resumed_names()
        res.timings["cast_s"] = _lap(t)
        t = time.perf_counter()
        prev = self._base_device(view)
        self._code_s = 0.0
        step, coded = (None, {}) if prev is None else self._diff(prev, view)
        for dt in view.values():
            if dt.state is None:  # new or reshaped tensor, or no previous view
                dt.state = sum128_state(dt.words)
        if step is not None and prev is not None:
            step = Patch(prev.digest(), view.digest(), step.tensors)
        res.timings["diff_s"] = _lap(t) - self._code_s
        res.host_bytes = self._host_bytes
        t = time.perf_counter() - self._code_s  # coding the step's records counts as encode
        blobs: list[tuple[int | None, str, bytes]] = []
        if step is not None and self.prev_version is not None:
            blob = wire.assemble_patch(self._with_meta(step, self.prev_version, version), coded)
            blobs.append((self.prev_version, "rpatch", blob))
            res.patch_bytes, res.changed = len(blob), step.n_changed
        res.accumulators, skips = self._advance_accumulators(version, step)
        for skip_base, composed in skips:
            assert composed is not None  # no base is rebuilt ahead on the device path
            skip_blob = self._skip_device(composed, view, skip_base, version)
            if skip_blob is not None:
                blobs.append((skip_base, "rpatch", skip_blob))
        if keyframe:
            blobs.append((None, "safetensors", view_to_bytes(view.host())))
        res.timings["encode_s"] = _lap(t)
        self._upload(res, blobs)
        return res

    # -- the device work ---------------------------------------------------------------------

    def _cast(self, masters: Mapping[str, Any]) -> DeviceView:
        """The served view on the masters' devices: BF16 in torch, other kinds on the host."""
        cfg = self.config
        f = get_format(cfg.format)
        prev = self.prev  # a DeviceView, or the host View of a resumed run
        out: dict[str, DeviceTensor] = {}
        for name, m in masters.items():
            shape = tuple(m.shape)
            if f.plain_kind == "bf16" and not f.quantises(name, shape, cfg.policy):
                served = {name: DeviceTensor(KINDS["bf16"], shape, bf16_words(m), None)}
            else:  # no torch twin of this format's arithmetic: numpy on the host, per tensor
                frozen = None
                if cfg.scales == "frozen" and prev is not None:
                    frozen = {
                        name + s: _host(prev[name + s])
                        for s in f.scale_suffixes
                        if name + s in prev
                    }
                host = f.cast_tensor(
                    name, to_numpy(m), frozen=frozen, scales=cfg.scales, policy=cfg.policy
                )
                served = {
                    s: DeviceTensor(t.kind, t.shape, from_host(t.data, m.device), None)
                    for s, t in host.items()
                }
            for s, dt in served.items():
                if s in out:
                    raise FormatError(
                        "two master tensors produce the same served name", tensor=s, format=f.name
                    )
                out[s] = dt
        return DeviceView(out, {"rollpatch.format": f.name, "rollpatch.scales": cfg.scales})

    def _base_device(self, view: DeviceView) -> DeviceView | None:
        """The previous view on the device (a resumed host view is copied there once)."""
        if self.prev is None or isinstance(self.prev, DeviceView):
            return self.prev
        host: View = self.prev
        moved = {}
        # a shard's base is cut to its names; an unsharded one keeps all (drops: DropOp)
        anywhere = next((view[n].words.device for n in view), "cpu")  # for a dropped tensor
        for name in (n for n in view if n in host) if self._whole_prev else host:
            t, dev = host[name], view[name].words.device if name in view else anywhere
            moved[name] = DeviceTensor(
                t.kind, t.shape, from_host(t.data, dev), host.sum_state(name)
            )
        return DeviceView(moved, host.metadata)

    def _diff(
        self, prev: DeviceView, view: DeviceView
    ) -> tuple[Patch, dict[str, tuple[str, bytes]]]:
        """The step patch's tensors (digests filled in by the caller) and their payloads."""
        tensors: dict[str, TensorPatch] = {}
        coded: dict[str, tuple[str, bytes]] = {}
        self._host_bytes, self._code_s = 0, 0.0
        for name in sorted(set(prev) | set(view)):
            if name not in view:
                pa = prev[name]
                tensors[name] = TensorPatch(name, pa.kind, pa.shape, pa.digest(), None, DropOp())
                coded[name] = ("none", b"")
                continue
            nb = view[name]
            if name not in prev or (prev[name].kind, prev[name].shape) != (nb.kind, nb.shape):
                nb.state = sum128_state(nb.words)
                full = nb.host().copy()
                base = prev[name].digest() if name in prev else None
                tensors[name] = TensorPatch(
                    name, nb.kind, nb.shape, base, nb.digest(), FullOp(full)
                )
                coded[name] = encode_full(full)
                self._host_bytes += full.nbytes
                continue
            pa = prev[name]
            rec = records(nb.kind, pa.words, nb.words, pa.state)
            nb.state = rec.state
            self._host_bytes += rec.nbytes
            if rec.positions.size == 0:
                continue
            tensors[name] = TensorPatch(
                name,
                nb.kind,
                nb.shape,
                pa.digest(),
                nb.digest(),
                DeltaOp(rec.positions, rec.old, rec.new),
            )
            t = time.perf_counter()
            coded[name] = _delta_payload(nb.kind, nb.n_elements, rec)
            self._code_s += time.perf_counter() - t
        return Patch("", "", tensors), coded

    def _skip_device(
        self, composed: Patch, view: DeviceView, base: int, version: int
    ) -> bytes | None:
        """The skip patch from ``base``: each tensor rewound on the device, then coded."""
        try:
            composed.inverse()
        except PatchError:  # a tensor was added, dropped or reshaped: step patches only
            return None
        coded: dict[str, tuple[str, bytes]] = {}
        for name, tp in composed.tensors.items():
            ch = tp.changes()  # inverse() proved every op a delta
            nb = view[name]
            assert nb.state is not None
            rewound = nb.words.clone()
            scatter_elements(rewound, nb.kind, ch.positions, ch.old)
            dev_pos = torch.from_numpy(ch.positions).to(rewound.device)
            state = sum128_update(nb.state, nb.words, rewound, dev_pos, nb.kind)
            if DeviceTensor(nb.kind, nb.shape, rewound, state).digest() != tp.base_digest:
                raise BoardError(
                    "skip patch does not rewind to its base (internal error)",
                    tensor=name,
                    version=version,
                    base=base,
                )
            rec = records(nb.kind, rewound, nb.words)
            coded[name] = _delta_payload(nb.kind, nb.n_elements, rec)
        return wire.assemble_patch(self._with_meta(composed, base, version), coded)


def _host(t: DeviceTensor | Tensor) -> Tensor:
    return t.host() if isinstance(t, DeviceTensor) else t


def _delta_payload(kind: Any, n: int, rec: TensorRecords) -> tuple[str, bytes]:
    """What ``wire.encode`` writes for a delta tensor: ctxgolomb v2, or XOR+zstd if dense and
    smaller (XOR+zstd needs only the positions and the old and new elements)."""
    payload = CtxGolombV2().encode_records(kind, n, rec.chunks)
    if rec.positions.size > wire.DENSE * n:
        alt = XorZstd().encode_changes(kind, n, rec.positions, rec.old, rec.new)
        if len(alt) < len(payload):
            return "rp.xorzstd.v1", alt
    return "rp.ctxgolomb.v2", payload
