"""Regenerate the golden patches (``python -m tests.golden.make_golden``). Only do this on a
deliberate format change, with a new format version: the committed files are decoded by the
tests forever, so an accidental codec change cannot slip through."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import numpy as np

from rollpatch.io import save_view
from rollpatch.kinds import KINDS
from rollpatch.patch import diff, encode
from rollpatch.view import Tensor, View
from tests.patchfix import sample_views

HERE = Path(__file__).parent


def cases() -> dict[str, tuple[View, View]]:
    a, b = sample_views(seed=2026, n=66_000)
    dense = b.copy()
    flipped = a["model.q"].data.copy()
    flipped[::3] ^= 0x80  # sign flips: huge key deltas, but a very regular XOR pattern
    flipped[1::3] ^= 0x80
    dense["model.q"] = Tensor(KINDS["e4m3"], (64, 64), flipped)
    structural = View(dict(b))
    del structural["model.s"]
    structural["model.new"] = Tensor(KINDS["int4x2"], (4, 4), np.arange(16, dtype=np.uint8))
    return {"step": (a, b), "dense_fp8": (a, dense), "structural": (a, structural)}


def main() -> None:
    out = {}
    base = None
    for name, (a, b) in cases().items():
        base = a
        blob = encode(diff(a, b), a)
        (HERE / f"{name}.rpatch").write_bytes(blob)
        out[name] = {"target": b.digest(), "b3": blake3.blake3(blob).hexdigest(),
                     "bytes": len(blob)}
    assert base is not None
    save_view(base, HERE / "base.safetensors")
    out["base"] = {"root": base.digest()}
    (HERE / "expected.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
