"""The publisher's snapshot of a state dict: what it accepts as masters (one check, before
any copy) and the host copies or served views it keeps until the worker publishes them."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import native
from ..errors import ConfigError, FormatError
from ..formats import cast_view, get_format
from ..io.checkpoint import to_numpy

if TYPE_CHECKING:
    from .cast import HostSnapshots
    from .config import PublisherConfig
from ..kinds import KINDS
from ..view import Tensor, View
from .config import PublisherConfig
from .sharded_slices import split_slices
from .wordpool import WordPool

__all__ = [
    "check_dtype",
    "check_masters",
    "snapshot_masters",
    "snapshot_served",
    "snapshot_state",
    "take_snapshot",
]

#: The dtypes a master may have (the served formats cast from these).
MASTER_DTYPES = ("float32", "bfloat16", "float16")

#: Master elements from which the served snapshot casts on several threads (below it, a
#: pool's start costs about what the threads would save).
_THREADED_CAST_MIN = 1 << 20


def check_dtype(name: str, dtype: str) -> None:
    """A master of dtype ``dtype`` (its name: ``float32``...) is one the publisher casts."""
    if dtype not in MASTER_DTYPES:
        raise ConfigError(
            f"cannot publish {dtype} tensor {name!r}",
            hint="publish float32/bfloat16/float16 parameters only; leave "
            "buffers and integer tensors out of the state dict",
        )


def check_masters(state_dict: Mapping[str, Any], *, sharded: bool = False) -> None:
    """What every snapshot path needs of the masters, checked before any is taken, from
    their attributes only (no copy): names, then for torch tensors the device (a meta tensor
    has no values), the layout (dense) and the dtype; numpy arrays by their dtype. An empty
    state dict is refused unless ``sharded`` (a rank may hold no tensor of its own)."""
    if not state_dict and not sharded:
        raise ConfigError(
            "the state dict is empty: nothing to publish",
            hint="pass the model's parameters (e.g. model.state_dict())",
        )
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise ConfigError("state dict keys must be tensor names (str)", key=repr(name))
        dtype = getattr(value, "dtype", None)
        if type(value).__module__.startswith("torch"):
            device = getattr(value, "device", None)
            if device is not None and device.type == "meta":
                raise ConfigError(
                    f"tensor {name!r} is on the meta device: it has no values",
                    hint="materialise the model's weights before publishing",
                )
            layout = str(getattr(value, "layout", "torch.strided")).removeprefix("torch.")
            if layout != "strided":
                raise ConfigError(
                    f"tensor {name!r} is {layout}, not dense", hint="publish dense tensors"
                )
        if dtype is not None:
            check_dtype(name, getattr(dtype, "name", str(dtype).removeprefix("torch.")))


def snapshot_state(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Host copies of every tensor (numpy or torch on any device) that nothing else shares."""
    out: dict[str, np.ndarray] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise ConfigError("state dict keys must be tensor names (str)", key=repr(name))
        arr = to_numpy(value)
        on_device = not isinstance(value, np.ndarray) and value.device.type != "cpu"
        check_dtype(name, arr.dtype.name)
        out[name] = arr if on_device else np.array(arr, copy=True, order="C")
    return out


def snapshot_served(
    state_dict: Mapping[str, Any], config: PublisherConfig, pool: WordPool | None = None
) -> View:
    """The served view of ``state_dict``, cast tensor by tensor: the snapshot holds the served
    bits (a BF16 view is half the FP32 masters), and no host copy of the masters is ever
    whole (one tensor's at a time, only for masters off the CPU).

    Masters all on the CPU are cast on :func:`rollpatch.native.threads` threads, tensors at
    once (the cast is numpy in cache-sized chunks, which releases the GIL): the trainer's
    call and the version's time to LATEST shrink with the free cores; the bits are the same.
    ``pool``: where the BF16 words of a torch cast are written (buffers of earlier snapshots
    that nothing references any more, already paged in; :mod:`.wordpool`)."""

    fmt = get_format(config.format)
    torch_cast = _torch_cast()
    plain_meta = dict(cast_view({}, fmt, scales=config.scales).metadata)

    def cast_one(item: tuple[str, Any]) -> View:
        name, value = item
        one = snapshot_state({name: value}) if _off_cpu(value) else None
        arr = one[name] if one is not None else _host_master(name, value)
        if (
            torch_cast is not None
            and fmt.plain_kind == "bf16"
            and torch_cast.castable(arr)
            and not fmt.quantises(name, arr.shape, config.policy)
        ):  # one torch pass, bit for bit formats' cast (publisher/cast.py)
            out = None if pool is None else pool.take(name, arr.size)
            words = torch_cast.host_words(arr, out)
            return View({name: Tensor(KINDS["bf16"], arr.shape, words)}, plain_meta)
        part = cast_view({name: arr}, config.format, policy=config.policy, scales=config.scales)
        # the trainer may change its tensors as soon as publish() returns
        return View(
            {k: t.copy() if np.shares_memory(t.data, arr) else t for k, t in part.items()},
            part.metadata,
        )

    items = list(state_dict.items())
    small = sum(_n_elements(v) for _, v in items) < _THREADED_CAST_MIN
    if small or any(_off_cpu(v) for _, v in items):  # one host copy at a time off the CPU
        parts = [cast_one(x) for x in items]
    else:
        parts = native.parallel_map(cast_one, items)
    out: dict[str, Tensor] = {}
    meta: dict[str, str] = {}
    for part in parts:
        meta = dict(part.metadata)
        for served, t in part.items():
            if served in out:
                raise FormatError(
                    "two master tensors produce the same served name",
                    tensor=served,
                    format=config.format,
                )
            out[served] = t
    if not meta:
        meta = dict(cast_view({}, config.format, scales=config.scales).metadata)
    return View(out, meta)


def _torch_cast() -> ModuleType | None:
    """:mod:`.cast` when this process has imported torch (every trainer has): importing it
    for a numpy caller would cost seconds and hundreds of MB for a cast numpy also does."""
    if "torch" not in sys.modules:
        return None
    from . import cast

    return cast


def _n_elements(value: Any) -> int:
    """Elements of a numpy array or torch tensor (0 for anything else: refused later)."""
    if isinstance(value, np.ndarray):
        return int(value.size)
    numel = getattr(value, "numel", None)
    return int(numel()) if callable(numel) else 0


def _off_cpu(value: Any) -> bool:
    device = getattr(value, "device", None)
    return not isinstance(value, np.ndarray) and device is not None and device.type != "cpu"


def _host_master(name: str, value: Any) -> np.ndarray:
    """A CPU tensor as numpy (no copy), checked like :func:`snapshot_state`."""
    if not isinstance(name, str):
        raise ConfigError("state dict keys must be tensor names (str)", key=repr(name))
    arr = to_numpy(value)
    check_dtype(name, arr.dtype.name)
    return arr


def take_snapshot(
    state_dict: Mapping[str, Any],
    slices: Mapping[str, Any],
    config: PublisherConfig,
    snaps: HostSnapshots,
    on_device: bool,
    sharded: bool,
) -> dict[str, Any]:
    """What ``publish()`` keeps of ``state_dict``: copies on the masters' devices
    (``on_device``: the writer's choice), or on the host the served view cast tensor by tensor
    (``snapshot="served"``) or a copy of the masters."""
    if on_device and slices:
        raise ConfigError(
            "sliced tensors (DTensor shards, TensorSlice) are published on the host path",
            tensor=min(slices),
            hint="PublisherConfig(diff_on='host')",
        )
    if on_device:
        from .devpipe import snapshot_device

        return snapshot_device(state_dict)
    if config.snapshot == "served" and config.scales != "frozen":
        # the cast lists the step's changes when skip patches need them (unsharded: a sharded
        # rank's base may be another rank's resume)
        compare = bool(config.skip_strides) and not sharded and not slices
        return snaps.take(state_dict, config, compare=compare)  # type: ignore[return-value]
    return snapshot_state(state_dict)


def snapshot_masters(
    state_dict: Mapping[str, Any],
    config: PublisherConfig,
    snaps: HostSnapshots,
    decide_device: Callable[[Mapping[str, Any]], bool],
    *,
    sharded: bool,
) -> tuple[dict[str, Any], dict[str, Any], FormatError | None]:
    """One accepted state dict (names as the engine loads them): its snapshot, its sliced
    masters' specs, and the cast's error (e.g. NaN in a quantised tensor), which fails only
    this version when it is built."""
    local, slices = split_slices(state_dict)
    check_masters(local, sharded=sharded or bool(slices))
    try:
        on_device = decide_device(local)
        return take_snapshot(local, slices, config, snaps, on_device, sharded), slices, None
    except FormatError as e:
        return {}, slices, e
