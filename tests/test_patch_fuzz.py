"""Hostile, corrupt and truncated patches: always a clear RollpatchError, never applied.

Three layers: random byte flips (caught by checksums), hostile content re-sealed with valid
checksums (caught by the bounded parser and the codec's consistency checks, or by digest
verification at apply), and the committed folder of hand-made attacks in tests/hostile/.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpatch.errors import PatchDecodeError, RollpatchError
from rollpatch.patch import apply, decode, diff, encode, inspect
from tests.patchfix import reseal, sample_views, split_blob

A, B = sample_views()
BLOB = encode(diff(A, B), A)
HEADER, PAYLOAD = split_blob(BLOB)
HOSTILE = Path(__file__).parent / "hostile"


def _must_not_apply(blob: bytes) -> None:
    """Decoding either fails cleanly, or applying fails cleanly and leaves A untouched."""
    view = A.copy()
    before = view.digest()
    try:
        patch = decode(blob, view)
        apply(view, patch)
    except RollpatchError:
        view.invalidate()
        assert view.digest() == before
        return
    # A mutation that still decodes must give exactly B (e.g. flipping an unused JSON space).
    view.invalidate()
    assert view.digest() == B.digest()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(
        st.tuples(st.integers(0, len(BLOB) - 1), st.integers(1, 255)), min_size=1, max_size=4
    )
)
def test_random_byte_flips(flips: list[tuple[int, int]]) -> None:
    blob = bytearray(BLOB)
    for pos, x in flips:
        blob[pos] ^= x
    _must_not_apply(bytes(blob))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(
        st.tuples(st.integers(0, len(PAYLOAD) - 1), st.integers(1, 255)), min_size=1, max_size=6
    )
)
def test_hostile_payloads_with_valid_checksums(flips: list[tuple[int, int]]) -> None:
    payload = bytearray(PAYLOAD)
    for pos, x in flips:
        payload[pos] ^= x
    _must_not_apply(reseal(copy.deepcopy(HEADER), bytes(payload)))


FIELD_ATTACKS = [
    ("shape", [2**47, 2**47]),
    ("shape", [-1]),
    ("shape", [1] * 40),
    ("changed", 10**12),
    ("changed", -1),
    ("offset", 10**15),
    ("length", 10**15),
    ("kind", "nope"),
    ("kind", "f32"),
    ("dtype", "F4"),
    ("op", "explode"),
    ("codec", "pickle"),
    ("codec", "rp.xorzstd.v1"),
    ("name", ""),
    ("name", "x" * 5000),
    ("base", "00"),
    ("target", None),
    ("op", "drop"),
    ("op", "full"),
    ("changed", 0),
    ("changed", "7"),
    ("shape", "big"),
    ("offset", True),
    ("shape", [True, 4]),
    ("name", "\ud800"),  # a lone surrogate: valid JSON, not UTF-8
    ("base", "0" * 64 + "\n"),
    ("b3", "A" * 64),
    ("changed", 16.0),
]


@pytest.mark.parametrize("field,value", FIELD_ATTACKS)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_hostile_header_fields(field: str, value: object, index: int) -> None:
    header = copy.deepcopy(HEADER)
    header["tensors"][index][field] = value
    _must_not_apply(
        reseal(header, PAYLOAD, fix_payload_checksums=field not in ("offset", "length"))
    )


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: h.update(tensors=h["tensors"][::-1]),
        lambda h: h.update(tensors=h["tensors"] + [h["tensors"][0]]),
        lambda h: h.update(payload_bytes=h["payload_bytes"] + 1),
        lambda h: h.update(version=2),
        lambda h: h.update(base="f" * 64),
        lambda h: h.update(target="0" * 64),
        lambda h: h.update(meta={"a": 1}),
        lambda h: h.update(tensors="all"),
        lambda h: h.pop("tensors"),
    ],
)
def test_hostile_header_structure(mutate) -> None:  # type: ignore[no-untyped-def]
    header = copy.deepcopy(HEADER)
    mutate(header)
    _must_not_apply(reseal(header, PAYLOAD))


def test_every_truncation_is_refused() -> None:
    for cut in list(range(80)) + list(range(80, len(BLOB), max(1, len(BLOB) // 200))):
        with pytest.raises(RollpatchError):
            inspect(BLOB[:cut])
        with pytest.raises(RollpatchError):
            decode(BLOB[:cut], A)


def test_header_refusals_name_the_check() -> None:
    """Each refused field gets the header error of its own check (a PatchDecodeError, never a
    UnicodeEncodeError or a TypeError from a later check)."""
    for field, value, what in [
        ("name", "\ud800", "tensor name"),
        ("shape", [True, 4], "shape"),
        ("base", "0" * 64 + "\n", "tensor digests"),
        ("b3", "A" * 64, "payload checksum"),
        ("offset", -1, "payload span"),
        ("codec", ["rp.xorzstd.v1"], "codec"),
    ]:
        header = copy.deepcopy(HEADER)
        header["tensors"][0][field] = value
        with pytest.raises(PatchDecodeError, match=f"invalid patch header: {what}"):
            inspect(reseal(header, PAYLOAD, fix_payload_checksums=field != "b3"))


def test_trailing_garbage_is_refused() -> None:
    with pytest.raises(RollpatchError):
        inspect(BLOB + b"\x00")


def test_zip_bomb_full_tensor_is_bounded() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))
    header = {
        "format": "rollpatch.patch",
        "version": 2,
        "digest": "rp.sum128.v1",
        "base": A.digest(),
        "target": A.digest(),
        "payload_bytes": len(bomb),
        "meta": {},
        "tensors": [
            {
                "name": "zz",
                "op": "full",
                "kind": "u8",
                "dtype": "U8",
                "shape": [16],
                "changed": 16,
                "base": None,
                "target": "0" * 64,
                "codec": "zstd",
                "offset": 0,
                "length": len(bomb),
                "b3": "",
            }
        ],
    }
    with pytest.raises(RollpatchError, match="declares the wrong size"):
        decode(reseal(header, bomb), A)


@pytest.mark.parametrize("path", sorted(HOSTILE.glob("*.rpatch")), ids=lambda p: p.name)
def test_hostile_folder(path: Path) -> None:
    """Each committed attack names the error it must raise in its sidecar .json."""
    expect = json.loads(path.with_suffix(".json").read_text())
    with pytest.raises(RollpatchError, match=expect["match"]):
        patch = decode(path.read_bytes(), A)
        apply(A.copy(), patch)


def test_hostile_folder_is_not_empty() -> None:
    assert len(list(HOSTILE.glob("*.rpatch"))) >= 8


def test_fuzz_base_is_deterministic() -> None:
    assert np.array_equal(sample_views()[0]["model.w"].data, A["model.w"].data)
