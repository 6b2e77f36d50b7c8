"""Regenerate golden patches of one format version (``python -m tests.golden.make_golden 2``).

Only on a deliberate format change, and only for a *new* format version: the committed
files of every version are decoded by the tests forever, and tests/test_golden.py pins their
BLAKE3 (FROZEN), so an accidental codec change cannot slip through.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import blake3
import ml_dtypes
import numpy as np

from rollpatch.io import save_view
from rollpatch.kinds import KINDS
from rollpatch.patch import diff, encode
from rollpatch.patch.wire import DIGESTS
from rollpatch.view import Tensor, View
from tests.patchfix import sample_views

HERE = Path(__file__).parent


def cases(version: int) -> dict[str, tuple[View, View]]:
    a, b = sample_views(seed=2026, n=66_000)
    if version >= 2:  # a tensor of two chunks (2^20 elements each) and a 4-bit context tensor
        rng = np.random.default_rng(7)
        big = (rng.standard_normal(1_100_000) * 0.05).astype(ml_dtypes.float8_e4m3fn)
        big2 = big.view(np.uint8).copy()
        big2[rng.choice(big2.size, 3000, replace=False)] += 1
        nib = rng.integers(0, 256, 40_000, dtype=np.uint8)
        nib2 = nib.copy()
        nib2[::97] ^= 0x20
        for v, words, codes in ((a, big.view(np.uint8), nib), (b, big2, nib2)):
            v["model.big"] = Tensor(KINDS["e4m3"], (1100, 1000), words.copy())
            v["model.fp4"] = Tensor(KINDS["e2m1x2"], (200, 200), codes.copy())
    dense = b.copy()
    flipped = a["model.q"].data.copy()
    flipped[::3] ^= 0x80  # sign flips: huge key deltas, but a very regular XOR pattern
    flipped[1::3] ^= 0x80
    dense["model.q"] = Tensor(KINDS["e4m3"], (64, 64), flipped)
    structural = View(dict(b))
    del structural["model.s"]
    structural["model.new"] = Tensor(KINDS["int4x2"], (4, 4), np.arange(16, dtype=np.uint8))
    return {"step": (a, b), "dense_fp8": (a, dense), "structural": (a, structural)}


def main(version: int) -> None:
    here = HERE / f"v{version}"
    here.mkdir(exist_ok=True)
    algo = DIGESTS[version]
    out = {}
    base = None
    for name, (a, b) in cases(version).items():
        base = a
        blob = encode(diff(a, b, digest=algo), a, version=version)
        (here / f"{name}.rpatch").write_bytes(blob)
        out[name] = {
            "target": b.digest(algo),
            "b3": blake3.blake3(blob).hexdigest(),
            "bytes": len(blob),
        }
    assert base is not None
    save_view(base, here / "base.safetensors")
    out["base"] = {"root": base.digest(algo)}
    (here / "expected.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]))
