"""bench/peers.py's XOR+zstd-1 peer: its container round-trips bit for bit, and its xxh3-128
check catches a corrupted frame (the benchmark's baseline must be as careful as Stitch's)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("xxhash")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _baselines import RoundTripError, xor_encode
from _peers_xor import apply_blob, decode_blob, encode_blob

from rollpatch.formats import cast_view


def _views() -> tuple[object, object]:
    rng = np.random.default_rng(0)
    a = {f"t{i}": rng.standard_normal((64, 33)).astype(np.float32) for i in range(3)}
    b = {
        k: v + np.float32(1e-3) * rng.standard_normal(v.shape).astype(np.float32)
        for k, v in a.items()
    }
    return cast_view(a, "bf16"), cast_view(b, "bf16")


def test_xz1_round_trip_is_bit_exact() -> None:
    a, b = _views()
    with ThreadPoolExecutor(2) as pool:
        blob = encode_blob(xor_encode(a, b, pool, 1))
        assert set(decode_blob(blob)) == set(b)
        replica = a.copy()
        apply_blob(replica, blob, pool)
    assert replica.digest() == b.digest()


def test_xz1_detects_corruption_and_malformed_input() -> None:
    a, b = _views()
    with ThreadPoolExecutor(2) as pool:
        frames = xor_encode(a, b, pool, 1)
        name = min(frames)
        frame, _ = frames[name]
        frames[name] = (frame, bytes(16))  # a wrong xxh3-128
        with pytest.raises(RoundTripError, match="checksum"):
            apply_blob(a.copy(), encode_blob(frames), pool)
    with pytest.raises(ValueError, match="not an XZ1"):
        decode_blob(b"XYZ\0" + bytes(8))
    with pytest.raises(ValueError, match="out of bounds"):
        decode_blob(b"XZ1\0" + (10**6).to_bytes(4, "little"))
