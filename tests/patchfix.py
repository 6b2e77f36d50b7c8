"""Shared fixtures for codec tests: small deterministic views and a resealer for hostile patches."""

from __future__ import annotations

import json
import struct

import blake3
import ml_dtypes
import numpy as np
import zstandard

from rollpatch.kinds import KINDS
from rollpatch.view import Tensor, View


def sample_views(seed: int = 0, n: int = 70_000) -> tuple[View, View]:
    """Two consecutive views with several kinds (bf16 big enough for contexts, fp8, 4-bit)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    w2 = w + (5e-6 * rng.standard_normal(n)).astype(np.float32)
    q = rng.integers(0, 256, 4096, dtype=np.uint8)
    q2 = q.copy()
    q2[rng.choice(q.size, 40, replace=False)] += 1
    nib = rng.integers(0, 256, 512, dtype=np.uint8)
    nib2 = nib.copy()
    nib2[::37] ^= 0x10
    nib2[::53] ^= 0x01

    def view(weights: np.ndarray, e4m3: np.ndarray, packed: np.ndarray) -> View:
        return View(
            {
                "model.w": Tensor.from_array(weights.astype(ml_dtypes.bfloat16).reshape(-1, 100)),
                "model.q": Tensor(KINDS["e4m3"], (64, 64), e4m3),
                "model.p": Tensor(KINDS["e2m1x2"], (16, 32), packed),
                "model.s": Tensor.from_array(np.array([0.5, -0.25], dtype=np.float32)),
            }
        )

    return view(w, q, nib), view(w2, q2, nib2)


def split_blob(blob: bytes) -> tuple[dict, bytes]:
    """(header dict, payload bytes) of a well-formed patch."""
    flags, hlen = struct.unpack_from("<HI", blob, 10)
    raw = blob[16 : 16 + hlen]
    header = json.loads(zstandard.ZstdDecompressor().decompress(raw) if flags & 1 else raw)
    return header, blob[16 + hlen + 32 :]


def reseal(header: dict, payload: bytes, fix_payload_checksums: bool = True) -> bytes:
    """Rebuild a patch with valid checksums around arbitrary (hostile) content."""
    if fix_payload_checksums:
        for e in header.get("tensors", []):
            try:
                chunk = payload[e["offset"] : e["offset"] + e["length"]]
                e["b3"] = blake3.blake3(chunk).hexdigest()
            except (KeyError, TypeError):
                pass
    raw = json.dumps(header).encode()
    version = header.get("version") if isinstance(header, dict) else 1
    version = version if isinstance(version, int) and 0 <= version < 1 << 16 else 1
    prefix = b"\x89RPATCH\n" + struct.pack("<HHI", version, 0, len(raw)) + raw
    return prefix + blake3.blake3(prefix).digest() + payload
