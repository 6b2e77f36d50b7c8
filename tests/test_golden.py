"""Committed golden patches must decode, apply and re-encode bit for bit, forever."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest

from rollpatch.io import load_view
from rollpatch.patch import apply, decode, encode, inspect

GOLDEN = Path(__file__).parent / "golden"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
CASES = sorted(k for k in EXPECTED if k != "base")


def test_base_digest_is_stable() -> None:
    assert load_view(GOLDEN / "base.safetensors").digest() == EXPECTED["base"]["root"]


@pytest.mark.parametrize("case", CASES)
def test_golden_patch(case: str) -> None:
    blob = (GOLDEN / f"{case}.rpatch").read_bytes()
    assert blake3.blake3(blob).hexdigest() == EXPECTED[case]["b3"]
    base = load_view(GOLDEN / "base.safetensors")
    info = inspect(blob)
    assert info.base == base.digest()
    patch = decode(blob, base)
    assert encode(patch, base) == blob, "the encoder's output changed: bump the format version"
    out = apply(base.copy(), patch)
    assert out.digest() == EXPECTED[case]["target"]


def test_golden_covers_codecs() -> None:
    codecs = {e["codec"] for case in CASES
              for e in inspect((GOLDEN / f"{case}.rpatch").read_bytes()).tensors}
    assert {"rp.ctxgolomb.v1", "rp.xorzstd.v1", "none"} <= codecs
    assert codecs & {"zstd", "raw"}
