"""The device path of the publisher (``diff_on="device"``), on the CPU: the same bytes on the
board as the host path, records and digests equal to the numpy references, and no host copy
of the previous view."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rollpatch import native
from rollpatch.board import Board
from rollpatch.formats.base import plain_tensor
from rollpatch.formats.floats import f32_to_bf16_bits
from rollpatch.kinds import KINDS, Kind
from rollpatch.patch import DeltaOp, Patch, TensorPatch, encode
from rollpatch.patch.codec_v2 import CtxGolombV2
from rollpatch.patch.ctxv2 import CHUNK
from rollpatch.patch.wire import assemble_patch
from rollpatch.publisher import Publisher, PublisherConfig, device, reconstruct
from rollpatch.publisher.devpipe import DeviceView, _delta_payload
from rollpatch.sim import AdamSim, SimConfig
from rollpatch.view import Tensor, View, sum128

pytestmark = pytest.mark.skipif(native.core is None, reason="the device path codes natively")
RUN = "r1"


def _f32(bits: list[int]) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


SPECIAL = [
    0x00000000,
    0x80000000,  # ±0
    0x00000001,
    0x807FFFFF,
    0x00400000,
    0x00008000,  # f32 subnormals (round to 0 / bf16 subn.)
    0x00018000,
    0x00028000,
    0x00010000,  # bf16 subnormal ties (odd/even) and exact
    0x3F808000,
    0x3F818000,
    0x3F80C000,
    0x3F807FFF,  # ties to even both ways, near-ties
    0x7F7FFFFF,
    0xFF7F8000,
    0x7F7F7FFF,  # overflow to ±inf, largest finite
    0x7F800000,
    0xFF800000,  # ±inf
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0xFFBFFFFF,  # NaN: quiet, negative, signalling, payload
    0x7FFFFFFF,
    0x7F80FFFF,
]


def test_bf16_cast_on_device_is_bit_exact() -> None:
    """torch's cast plus the pinned NaN rule equals formats' BF16 cast on every special."""
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            _f32(SPECIAL),
            rng.standard_normal(300_000).astype(np.float32) * 0.02,
            rng.integers(0, 2**32, 100_000, dtype=np.uint32).view(np.float32),
        ]
    )
    got = device.bf16_words(torch.from_numpy(x)).numpy().view(np.uint16)
    assert np.array_equal(got, f32_to_bf16_bits(x))
    # a BF16 master keeps every bit, NaN payloads included; an FP16 master rounds once
    words = rng.integers(0, 2**16, 70_000, dtype=np.uint16)
    words[:4] = [0x7FC1, 0xFF81, 0x7F80, 0x8000]
    bf = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    assert np.array_equal(device.bf16_words(bf).numpy().view(np.uint16), words)
    h = rng.integers(0, 2**16, 70_000, dtype=np.uint16).view(np.float16)
    ref = plain_tensor(h, "bf16").data
    assert np.array_equal(device.bf16_words(torch.from_numpy(h)).numpy().view(np.uint16), ref)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 13, 4096, (1 << 23) + 3])
def test_sum128_on_device_equals_view_sum128(nbytes: int) -> None:
    rng = np.random.default_rng(nbytes)
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    assert device.sum128_state(torch.from_numpy(raw)) == sum128(raw)
    if nbytes % 2 == 0 and nbytes:
        words = torch.from_numpy(raw.view(np.int16).copy())
        assert device.sum128_state(words) == sum128(raw)


@pytest.mark.parametrize("kind", ["bf16", "e2m1x2", "int4x2", "e4m3_u8", "f32", "u8"])
def test_sum128_update_from_changed_words(kind: str) -> None:
    k = KINDS[kind]
    rng = np.random.default_rng(3)
    n = 100_003
    a = rng.integers(0, 255, n, dtype=np.uint8).astype(k.word_dtype)
    old, new = device.from_host(a, "cpu"), device.from_host(a, "cpu")
    pos = np.unique(rng.integers(0, k.elements(a.nbytes), 50)).astype(np.int64)
    vals = rng.integers(0, 16, pos.size).astype(k.elem_dtype)
    device.scatter_elements(new, k, pos, vals)
    st = device.sum128_update(device.sum128_state(old), old, new, torch.from_numpy(pos), k)
    assert st == sum128(device.to_host(new, k.word_dtype))


def _perturb(rng: np.random.Generator, k: Kind, a: np.ndarray, frac: float) -> np.ndarray:
    b = a.copy()
    n = k.elements(a.nbytes)
    pos = rng.choice(n, max(1, int(n * frac)), replace=False)
    if k.packed:
        t = Tensor(k, (a.size,), b)
        from rollpatch.patch.ops import gather, scatter

        scatter(
            t, np.sort(pos).astype(np.int64), (gather(t, np.sort(pos).astype(np.int64)) + 1) & 0x0F
        )
        return b
    b[pos] = b[pos] + 1
    return b


def _reference_records(k: Kind, a: Tensor, b: Tensor) -> list[tuple[Any, ...] | None]:
    """Per chunk (sizes, positions, contexts, ranks, old, new), in numpy (test_native's)."""
    ea, eb = a.elements(), b.elements()
    _, _, shift, bits = native.kind_tuple(k, ea.size)
    out: list[tuple[Any, ...] | None] = []
    for s in range(0, ea.size, CHUNK):
        old, new = ea[s : s + CHUNK], eb[s : s + CHUNK]
        pos = np.flatnonzero(old != new)
        if pos.size == 0:
            out.append(None)
            continue
        ctx = ((old.astype(np.uint64) >> np.uint64(shift)) & np.uint64((1 << bits) - 1)).astype(
            np.uint8
        )
        order = np.argsort(ctx, kind="stable")
        inv = np.empty(ctx.size, np.int64)
        inv[order] = np.arange(ctx.size)
        sizes = np.bincount(ctx, minlength=256)
        ranks = inv[pos] - (np.cumsum(sizes) - sizes)[ctx[pos]]
        out.append((sizes, pos, ctx[pos], ranks, old[pos], new[pos]))
    return out


@pytest.mark.parametrize(
    "kind,n,frac",
    [
        ("bf16", 2 * CHUNK + 70_001, 0.01),
        ("bf16", 1_000, 0.05),
        ("bf16", 200_000, 0.3),
        ("e2m1x2", CHUNK // 2 + 5_000, 0.02),
        ("int4x2", 90_000, 0.01),
        ("e4m3_u8", 300_000, 0.01),
        ("f32", 70_000, 0.02),
        ("u8", 100_000, 0.01),
    ],
)
def test_records_equal_the_numpy_reference(kind: str, n: int, frac: float) -> None:
    k = KINDS[kind]
    rng = np.random.default_rng(n)
    if kind == "bf16":
        w = (rng.standard_normal(n) * 0.02).astype(np.float32)
        a_words = f32_to_bf16_bits(w)
    else:
        a_words = rng.integers(0, np.iinfo(k.word_dtype).max, n, dtype=k.word_dtype, endpoint=True)
    a = Tensor(k, (n,), a_words)
    b = Tensor(k, (n,), _perturb(rng, k, a_words, frac))
    rec = device.records(
        k, device.from_host(a.data, "cpu"), device.from_host(b.data, "cpu"), sum128(a.data)
    )
    ref = _reference_records(k, a, b)
    assert len(rec.chunks) == len(ref)
    for got, want in zip(rec.chunks, ref):
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            fields = (got.sizes, got.positions, got.contexts, got.ranks, got.old, got.new)
            for g, w_ in zip(fields, want):
                assert np.array_equal(g, w_)
    pos = np.flatnonzero(a.elements() != b.elements())
    assert np.array_equal(rec.positions, pos)
    assert rec.state == sum128(b.data)
    payload = CtxGolombV2().encode_records(k, a.n_elements, rec.chunks)
    assert payload == CtxGolombV2().encode(a, pos, a.elements()[pos], b.elements()[pos])


def test_container_matches_wire_encode() -> None:
    """The device path's container (payloads coded from records) is wire.encode's bytes."""
    rng = np.random.default_rng(5)
    k = KINDS["bf16"]
    a_words = f32_to_bf16_bits((rng.standard_normal(150_000) * 0.02).astype(np.float32))
    b_words = _perturb(rng, k, a_words, 0.2)  # dense: XOR+zstd is tried too
    ta, tb = Tensor(k, (300, 500), a_words), Tensor(k, (300, 500), b_words)
    rec = device.records(k, device.from_host(a_words, "cpu"), device.from_host(b_words, "cpu"))
    tp = TensorPatch(
        "w", k, ta.shape, ta.digest(), tb.digest(), DeltaOp(rec.positions, rec.old, rec.new)
    )
    p = Patch("a" * 64, "b" * 64, {"w": tp}, {"run": "x"})
    coded = {"w": _delta_payload(k, ta.n_elements, rec)}
    assert assemble_patch(p, coded) == encode(p, View({"w": ta}))


#: _versions adds a tensor, puts NaNs in one and drops it again: what the guards refuse by
#: default (tests/test_publisher_guards.py), let through here to compare the two paths' bytes.
_CHANGES: dict[str, Any] = {"model_changes": "allow", "nonfinite": "allow"}


def _versions(steps: int) -> list[dict[str, np.ndarray]]:
    sim = AdamSim(SimConfig(n_params=1_500_000, seed=1, lr=1e-5, vocab=1000, threads=1))
    out = []
    for i in range(steps):
        sim.step()
        m = {k: v.copy() for k, v in sim.masters().items()}
        if i == 1:
            m["extra.norm.weight"] = np.ones(77, np.float32)  # a new tensor (full op) ...
        if i in (1, 2, 3):
            m["extra.norm.weight"] = np.full(77, 1 + i / 8, np.float32)
        if i == 2:  # ... NaNs (BF16 keeps them)
            m["model.norm.weight"][:3] = [np.nan, -np.nan, np.inf]
        out.append(m)  # dropped again at i == 4
    return out


def _publish(
    uri: str, cfg: PublisherConfig, versions: list[dict[str, np.ndarray]], as_torch: bool
) -> Publisher:
    pub = Publisher(uri, RUN, cfg, asynchronous=False)
    for m in versions:
        sd = {k: torch.from_numpy(v.copy()) for k, v in m.items()} if as_torch else m
        pub.publish(sd)
    return pub


def _board_bytes(board: Board) -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    objects = {
        k.rsplit("/", 1)[-1]: board.store.get(k) for k in board.store.list("") if "/objects/" in k
    }
    manifests = []
    for v in board.versions(RUN):
        d = board.manifest(RUN, v).to_json()
        d.pop("created")
        manifests.append(d)
    return objects, manifests


@pytest.mark.parametrize("fmt", ["bf16", "fp8-e4m3-block128", "nvfp4"])
def test_device_path_publishes_the_same_bytes(fmt: str) -> None:
    """Step and skip patches, keyframes and manifests are byte-identical to the host path."""
    if fmt != "bf16":
        pytest.importorskip("ml_dtypes")
    versions = _versions(7)
    if fmt != "bf16":
        for m in versions:
            m.pop("model.norm.weight")  # NaNs are a FormatError in quantised formats
    common: dict[str, Any] = {
        "format": fmt,
        "keyframe_every": 4,
        "skip_strides": (2, 4),
        "publisher_id": "test",
        **_CHANGES,
    }
    tag = uuid.uuid4().hex[:8]
    host = _publish(f"memory://host-{tag}", PublisherConfig(**common), versions, False)
    dev = _publish(
        f"memory://dev-{tag}", PublisherConfig(diff_on="device", **common), versions, True
    )
    h_objects, h_manifests = _board_bytes(host.board)
    d_objects, d_manifests = _board_bytes(dev.board)
    assert len(h_manifests) == 7
    assert sum(1 for m in h_manifests if len(m["patches"]) > 1) >= 2  # skip patches made
    assert h_manifests == d_manifests
    assert h_objects.keys() == d_objects.keys()
    assert all(h_objects[k] == d_objects[k] for k in h_objects)
    got = reconstruct(dev.board, RUN)
    assert got.digest() == dev.board.manifest(RUN, 6).target
    stats = dev.stats.versions
    assert all(s.host_bytes > 0 for s in stats[1:]) and host.stats.versions[1].host_bytes == 0
    host.close()
    dev.close()


def test_device_path_resumes_with_frozen_scales() -> None:
    """A resumed run (previous view rebuilt on the host, then moved to the device) with
    frozen scales publishes what the host path publishes."""
    versions = _versions(5)
    for m in versions:
        m.pop("model.norm.weight")
    common: dict[str, Any] = {
        "format": "fp8-e4m3-block128",
        "scales": "frozen",
        "keyframe_every": 100,
        "skip_strides": (4,),
        "publisher_id": "test",
        **_CHANGES,
    }
    tag = uuid.uuid4().hex[:8]
    boards = []
    for label, diff_on in (("host", "host"), ("dev", "device")):
        uri = f"memory://resume-{label}-{tag}"
        cfg = PublisherConfig(diff_on="device" if diff_on == "device" else "host", **common)
        _publish(uri, cfg, versions[:2], diff_on == "device").close()
        pub = _publish(uri, cfg, versions[2:], diff_on == "device")
        boards.append(_board_bytes(pub.board))
        pub.close()
    assert len(boards[0][1]) == 5 and boards[0] == boards[1]


def test_device_path_resumes_across_a_dropped_tensor() -> None:
    """A publisher restarted right before the trainer drops a tensor: the resumed view moved
    to the device keeps every tensor of the base, so the step drops it, as on the host path
    (byte-identical boards), and the last version rebuilds."""
    versions = _versions(6)  # "extra.norm.weight" is in versions 1-3, gone from 4 on
    boards = []
    for diff_on in ("host", "device"):
        uri = f"memory://resume-drop-{diff_on}-{uuid.uuid4().hex[:8]}"
        cfg = PublisherConfig(diff_on=diff_on, skip_strides=(2,), publisher_id="test", **_CHANGES)
        _publish(uri, cfg, versions[:4], diff_on == "device").close()
        pub = _publish(uri, cfg, versions[4:], diff_on == "device")
        assert pub.stats.versions[0].tensors_dropped == 1
        assert reconstruct(pub.board, RUN).digest() == pub.board.manifest(RUN, 5).target
        boards.append(_board_bytes(pub.board))
        pub.close()
    assert boards[0] == boards[1]


def test_device_path_keeps_no_host_copy_of_the_view() -> None:
    """What the publisher keeps between versions: the served words on the device only."""
    versions = _versions(3)
    cfg = PublisherConfig(diff_on="device", skip_strides=(2,), publisher_id="t", **_CHANGES)
    pub = _publish(f"memory://keep-{uuid.uuid4().hex[:8]}", cfg, versions, True)
    prev = pub._writer.pipe.prev
    assert isinstance(prev, DeviceView)
    assert all(isinstance(t.words, torch.Tensor) and t.state is not None for t in prev.values())
    n_view = prev.nbytes

    def host_arrays(x: Any, seen: set[int]) -> int:
        """Bytes of numpy arrays reachable from x (patches kept for skips are O(change))."""
        if id(x) in seen:
            return 0
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            return int(x.nbytes)
        if isinstance(x, dict):
            return sum(host_arrays(v, seen) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(host_arrays(v, seen) for v in x)
        if hasattr(x, "__dict__"):
            return host_arrays(vars(x), seen)
        if hasattr(x, "__dataclass_fields__"):
            return sum(host_arrays(getattr(x, f), seen) for f in x.__dataclass_fields__)
        return 0

    kept = host_arrays(pub._writer.pipe, set())
    assert kept < n_view // 20, (kept, n_view)
    assert not pub._pending
    pub.close()


def test_auto_stays_on_the_host_for_cpu_tensors() -> None:
    cfg = PublisherConfig(diff_on="auto", publisher_id="t")
    with Publisher(f"memory://auto-{uuid.uuid4().hex[:8]}", RUN, cfg, asynchronous=False) as pub:
        pub.publish({"w": torch.ones(4, 4)})
        assert not isinstance(pub._writer.pipe.prev, DeviceView)
