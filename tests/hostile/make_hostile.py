"""Regenerate the committed hostile patches (run from the repo root:
``python -m tests.hostile.make_hostile``). Each attack gets NAME.rpatch and NAME.json, the JSON
naming (as a regex) the error the decoder must raise."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import blake3
import zstandard

from rollpatch.patch import diff, encode
from tests.patchfix import reseal, sample_views, split_blob

HERE = Path(__file__).parent


def main() -> None:
    a, b = sample_views()
    blob = encode(diff(a, b), a)
    header, payload = split_blob(blob)
    delta = next(i for i, e in enumerate(header["tensors"]) if e["codec"] == "rp.ctxgolomb.v1")
    attacks: dict[str, tuple[bytes, str, str]] = {}

    def add(name: str, data: bytes, match: str, what: str) -> None:
        attacks[name] = (data, match, what)

    add("bad_magic", b"PK\x03\x04" + blob[4:], "bad magic", "a zip file, not a patch")
    add(
        "huge_header_len",
        blob[:12] + struct.pack("<I", 0xFFFFFFF0) + blob[16:],
        "header length out of bounds",
        "header length far beyond the file",
    )
    add(
        "header_checksum",
        blob[:20] + bytes([blob[20] ^ 1]) + blob[21:],
        "checksum",
        "one header byte flipped",
    )
    add(
        "version_99",
        blob[:8] + struct.pack("<H", 99) + blob[10:],
        "version",
        "a future format version",
    )
    add("flags_set", blob[:10] + struct.pack("<H", 4) + blob[12:], "flags", "reserved flags")
    raw = b"{not json"
    prefix = b"\x89RPATCH\n" + struct.pack("<HHI", 1, 0, len(raw)) + raw
    add(
        "header_not_json",
        prefix + blake3.blake3(prefix).digest(),
        "not JSON",
        "valid checksum over garbage JSON",
    )
    h = copy.deepcopy(header)
    h["tensors"][1]["offset"] = h["tensors"][0]["offset"]
    add(
        "overlapping_payloads",
        reseal(h, payload),
        "overlapping|checksum",
        "two tensors share payload bytes",
    )
    h = copy.deepcopy(header)
    e = h["tensors"][delta]
    evil = b"\xff" * 20
    e["length"], h["payload_bytes"] = len(evil), len(evil)
    e["offset"] = 0
    h["tensors"] = [e]
    add("varint_too_long", reseal(h, evil), "varint too long", "an endless varint")
    h = copy.deepcopy(header)
    e = h["tensors"][delta]
    evil = bytes([6, 1, 0, 1, 0, 0, 0]) + bytes([4]) + b"\xff\xff\xff\xff" + b"\x00"
    e["length"], h["payload_bytes"], e["offset"], e["changed"] = len(evil), len(evil), 0, 1
    h["tensors"] = [e]
    add(
        "unary_without_codes",
        reseal(h, evil),
        "unary stream|params",
        "unary stream of ones: no code ends",
    )
    h = copy.deepcopy(header)
    e = h["tensors"][delta]
    evil = bytes([5, 1, 0, 0x80, 0x80, 0x01]) + bytes([0])
    e["length"], h["payload_bytes"], e["offset"] = len(evil), len(evil), 0
    h["tensors"] = [e]
    add(
        "counts_disagree",
        reseal(h, evil),
        "params|add up|context",
        "context counts that do not add up to the changed count",
    )
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(32 << 20))
    h = {
        "format": "rollpatch.patch",
        "version": 1,
        "base": header["base"],
        "target": header["target"],
        "payload_bytes": len(bomb),
        "meta": {},
        "tensors": [
            {
                "name": "bomb",
                "op": "full",
                "kind": "u8",
                "dtype": "U8",
                "shape": [1024],
                "changed": 1024,
                "base": None,
                "target": "0" * 64,
                "codec": "zstd",
                "offset": 0,
                "length": len(bomb),
                "b3": "",
            }
        ],
    }
    add("zstd_bomb", reseal(h, bomb), "decompressed size", "32 MiB of zeros for a 1 KiB tensor")
    other, _ = sample_views(seed=99)
    add(
        "wrong_base",
        encode(diff(other, b), other),
        "not this patch's base",
        "a valid patch for another view",
    )
    h = copy.deepcopy(header)
    h["tensors"][delta]["shape"] = [7, 7]
    add(
        "shape_mismatch",
        reseal(h, payload),
        "layout differs",
        "delta for a differently shaped tensor",
    )
    for path in HERE.glob("*.rpatch"):
        path.unlink()
    for name, (data, match, what) in attacks.items():
        (HERE / f"{name}.rpatch").write_bytes(data)
        (HERE / f"{name}.json").write_text(json.dumps({"match": match, "what": what}) + "\n")


if __name__ == "__main__":
    main()
