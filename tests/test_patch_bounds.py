"""Decoder bounds on hostile format-2 patches: refused cleanly, before any large allocation.

Each case is one finding of the review behind issue #9 (a 33 KB patch that made ``apply``
grow to 2.1 GB, zstd headers parsed at 64 MiB before validation, unbounded expansions),
re-sealed with valid checksums so only the decoder's bounds stand between it and the
allocation. ``tracemalloc`` measures what numpy and Python allocate while decoding.
"""

from __future__ import annotations

import copy
import json
import struct
import tracemalloc

import blake3
import pytest
import zstandard

from rollpatch.errors import PatchDecodeError, RollpatchError
from rollpatch.patch import decode, diff, encode
from tests.patchfix import reseal, sample_views, split_blob

A, B = sample_views()
BLOB = encode(diff(A, B), A)
HEADER, PAYLOAD = split_blob(BLOB)


def _bounded(blob: bytes, limit: int = 64 << 20) -> RollpatchError:
    tracemalloc.start()
    try:
        with pytest.raises(RollpatchError) as info:
            decode(blob, A)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"decoding a hostile patch allocated {peak} bytes"
    return info.value


def test_full_op_of_a_huge_declared_shape_is_refused_before_decompressing() -> None:
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 20))  # 1 MiB of zeros
    h = copy.deepcopy(HEADER)
    h["payload_bytes"] = len(frame)
    h["tensors"] = [
        {
            "name": "zz",
            "op": "full",
            "kind": "u8",
            "dtype": "U8",
            "shape": [1 << 40],
            "changed": 1 << 40,
            "base": None,
            "target": "0" * 64,
            "codec": "zstd",
            "offset": 0,
            "length": len(frame),
            "b3": "",
        }
    ]
    err = _bounded(reseal(h, frame))
    assert "bound" in str(err)


def test_full_op_whose_frame_declares_another_size_is_refused() -> None:
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(8 << 20))
    h = copy.deepcopy(HEADER)
    h["payload_bytes"] = len(frame)
    h["tensors"] = [
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
            "length": len(frame),
            "b3": "",
        }
    ]
    assert "declares" in str(_bounded(reseal(h, frame)))


def _seal_raw_header(raw: bytes, version: int = 2) -> bytes:
    packed = zstandard.ZstdCompressor(level=19).compress(raw)
    prefix = b"\x89RPATCH\n" + struct.pack("<HHI", version, 1, len(packed)) + packed
    return prefix + blake3.blake3(prefix).digest()


def test_a_header_that_expands_far_beyond_its_size_is_refused() -> None:
    raw = json.dumps(HEADER).encode() + b" " * (48 << 20)  # valid JSON, 48 MiB of padding
    blob = _seal_raw_header(raw)
    assert len(blob) < 64 << 10
    _bounded(blob, limit=16 << 20)


@pytest.mark.parametrize(
    "doc", [b"[" * 200_000 + b"]" * 200_000, b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}']
)
def test_deep_or_non_strict_json_headers_are_refused(doc: bytes) -> None:
    err = _bounded(_seal_raw_header(doc))
    assert isinstance(err, PatchDecodeError)


@pytest.mark.parametrize("mutate", ["count_too_big", "table_short", "table_long", "nc_overflow"])
def test_hostile_v2_chunk_tables_and_params(mutate: str) -> None:
    h = copy.deepcopy(HEADER)
    entry = next(e for e in h["tensors"] if e["codec"] == "rp.ctxgolomb.v2")
    payload = bytearray(PAYLOAD)
    start, end = entry["offset"], entry["offset"] + entry["length"]
    body = bytes(payload[start:end])
    if mutate == "count_too_big":
        entry["changed"] = min(entry["changed"] * 1000, 70_000)
    elif mutate == "table_short":
        body = body[:-1]
    elif mutate == "table_long":
        body = body + b"\x00"
    else:  # claim a context larger than the chunk, valid varint
        body = body[:2] + b"\xff\xff\xff\x07" + body[3:]
    new_payload = bytes(payload[:start]) + body + bytes(payload[end:])
    delta = len(body) - entry["length"]
    entry["length"] = len(body)
    for e in h["tensors"]:
        if e["offset"] > start:
            e["offset"] += delta
    h["payload_bytes"] = len(new_payload)
    _bounded(reseal(h, new_payload))
