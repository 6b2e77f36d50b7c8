"""Committed golden patches of every format version must decode, apply and re-encode bit for
bit, forever — with the native core and with the numpy reference alike."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest

from rollpatch import native
from rollpatch.io import load_view
from rollpatch.patch import apply, decode, encode, inspect
from rollpatch.patch.wire import DIGESTS, VERSIONS

GOLDEN = Path(__file__).parent / "golden"
#: The bytes of every released format version, pinned here: regenerating a version's golden
#: files changes these hashes and fails the suite. A format change needs a new version.
FROZEN = {
    1: {
        "step": "d5b04e3ffe74532bafdffd9c13fc505ffe6bd7195ccc17e3e2ccd997f82a6171",
        "dense_fp8": "48ea19a94219cf537a1ab48273bf9740e6822947cb74a7e2aa16edba00bb2040",
        "structural": "e045d34b7f1b1d6a0b8e7d26ae9452edc0f902bd1ce77e9ab40bbfa7051751bc",
    },
    2: {
        "step": "d414e3a74ed6b6a83270f14eac440301691a5f7b126407cf35d1cd0403c5c250",
        "dense_fp8": "632c1bdd8a957c85b04294fef061385550914e69616e6d99528c64b853d5547f",
        "structural": "a04cf5b79a4914a1f4086fa29eb2980089deb8d8d2bf4f88505fb49de53dd359",
    },
}
CASES = [(v, c) for v in sorted(FROZEN) for c in sorted(FROZEN[v])]


@pytest.fixture(params=["native", "numpy"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setattr(native, "core", None)
    else:
        assert native.core is not None, "the native core is not built (pip install -e .)"
    return str(request.param)


def test_every_version_is_pinned() -> None:
    assert set(FROZEN) == set(VERSIONS)


@pytest.mark.parametrize("version", sorted(FROZEN))
def test_base_digest_is_stable(version: int) -> None:
    expected = json.loads((GOLDEN / f"v{version}" / "expected.json").read_text())
    base = load_view(GOLDEN / f"v{version}" / "base.safetensors")
    assert base.digest(DIGESTS[version]) == expected["base"]["root"]


@pytest.mark.parametrize(("version", "case"), CASES)
def test_golden_patch(version: int, case: str, impl: str) -> None:
    here = GOLDEN / f"v{version}"
    expected = json.loads((here / "expected.json").read_text())
    blob = (here / f"{case}.rpatch").read_bytes()
    assert blake3.blake3(blob).hexdigest() == FROZEN[version][case] == expected[case]["b3"]
    base = load_view(here / "base.safetensors")
    info = inspect(blob)
    assert info.version == version and info.digest == DIGESTS[version]
    assert info.base == base.digest(info.digest)
    patch = decode(blob, base)
    assert encode(patch, base, version=version) == blob, (
        "the encoder's output changed: that needs a new format version"
    )
    out = apply(base.copy(), patch)
    assert out.digest(info.digest) == expected[case]["target"]


def test_golden_covers_codecs() -> None:
    codecs = {
        e["codec"]
        for v, case in CASES
        for e in inspect((GOLDEN / f"v{v}" / f"{case}.rpatch").read_bytes()).tensors
    }
    assert {"rp.ctxgolomb.v1", "rp.ctxgolomb.v2", "rp.xorzstd.v1", "none"} <= codecs
    assert codecs & {"zstd", "raw"}
