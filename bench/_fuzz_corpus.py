"""The seed corpus of ``bench/fuzz_codec.py`` (``--make-corpus``): chunk headers and payloads
of every element kind the C core declares, written to src/rollpatch/native/fuzz/corpus/."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from _util import log

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "src" / "rollpatch" / "native"
FUZZ = NATIVE / "fuzz"
SEEDS = FUZZ / "corpus"
TARGETS = ("decode", "roundtrip")
CHUNK = 1 << 20


def c_kinds() -> list[tuple[int, int, int, int]]:
    """fuzz_common.h's KINDS table (one source for the harness and the corpus)."""
    text = (FUZZ / "fuzz_common.h").read_text()
    body = text[text.index("KINDS[] = {") : text.index("};", text.index("KINDS[] = {"))]
    return [
        (int(a), int(b), int(c), int(d))
        for a, b, c, d in re.findall(r"\{(\d+), (\d+), (\d+), (\d+)\}", body)
    ]


def header(kind: int, size_class: int, value: int, seed: int, spread: int = 0) -> bytes:
    """fuzz_common.h's 8-byte header (size class 8: class 7 with bit 6, two chunks)."""
    cls = 7 | 64 if size_class == 8 else size_class
    return (
        bytes([kind, cls | spread << 3]) + value.to_bytes(2, "little") + seed.to_bytes(4, "little")
    )


def elements(h: bytes, bits: int) -> int:
    """fz_elements: the element count a header selects."""
    v, cls = h[2] | h[3] << 8, h[1] & 7
    big = CHUNK - 32768 + v if h[1] & 64 else 1 + v
    n = {4: 1 + (v & 16383), 5: 1 + v, 6: 65536 + (v & 8191), 7: big}.get(cls, 1 + (v & 1023))
    return n + (n & 1) if bits == 4 else n


def base_words(kind: tuple[int, int, int, int], n: int, seed: int, spread: int) -> np.ndarray:
    """fz_word for i in [0, n): the base's elements as uint64 (numpy wraps like C)."""
    bits, _, shift, cbits = kind
    u = np.uint64
    with np.errstate(over="ignore"):
        z = u(seed) * u(0xD1B54A32D192ED03) + np.arange(1, n + 1, dtype=u) * u(0x9E3779B97F4A7C15)
        z = (z ^ (z >> u(30))) * u(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> u(27))) * u(0x94D049BB133111EB)
        z = z ^ (z >> u(31))
    e = z & u((1 << bits) - 1)
    if spread:
        fw = cbits or min(bits, 4)
        fs = shift if cbits else bits - fw
        fm = u((1 << fw) - 1)
        v = ((z >> u(40)) % u(spread) + u(seed >> 8)) & fm
        e = (e & ~(fm << u(fs))) | (v << u(fs))
    return e


def pack(bits: int, e: np.ndarray) -> bytes:
    """Elements to the tensor's bytes (4-bit: two per byte, low nibble first)."""
    if bits == 4:
        return ((e[0::2] | (e[1::2] << np.uint64(4))).astype(np.uint8)).tobytes()
    return e.astype(f"<u{bits // 8}").tobytes()


def varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def payload(kind_i: int, h: bytes, density: float, rng: np.random.Generator, lo: int = 0) -> bytes:
    """A real rp.ctxgolomb.v2 payload (the native encoder) of a perturbation of h's base
    (elements from ``lo`` on)."""
    from rollpatch import native

    core = native.require()
    kind = c_kinds()[kind_i]
    bits, spread = kind[0], (h[1] >> 3) & 7
    n = elements(h, bits)
    a = base_words(kind, n, int.from_bytes(h[4:8], "little"), spread)
    b = a.copy()
    hit = rng.random(n) < density
    hit[:lo] = False
    step = rng.integers(1, 4, n, dtype=np.uint64)
    wild = rng.random(n) < 0.1  # mostly small steps, as optimizer updates make, some far
    mask = np.uint64((1 << bits) - 1)
    b[hit] = (
        np.where(
            wild[hit],
            rng.integers(0, 1 << min(bits, 63), hit.sum(), dtype=np.uint64),
            a[hit] ^ step[hit],
        )
        & mask
    )
    nch = -(-n // CHUNK)
    bodies, _, _ = core.encode_range(kind, pack(bits, a), pack(bits, b), 0, nch)
    return b"".join(varint(len(body)) + body for body, _ in bodies)


def make_corpus(out: Path = SEEDS) -> None:
    """Rewrite the seed corpus: real payloads for every kind and size class, edge cases, and
    round-trip inputs with every edit op."""
    kinds = c_kinds()
    rng = np.random.default_rng(20261201)
    for t in TARGETS:
        d = out / t
        d.mkdir(parents=True, exist_ok=True)
        for f in d.iterdir():
            f.unlink()
    seeds: dict[str, bytes] = {}
    for i, (bits, _, _, cbits) in enumerate(kinds):
        h = header(i, 0, 300 + 17 * i, 1000 + i)
        seeds[f"k{i:02d}-small"] = h + payload(i, h, 0.05, rng)
        if cbits:  # a tensor large enough for contexts, a few dominant
            h = header(i, 6, 1000 + i, 2000 + i, spread=3)
            seeds[f"k{i:02d}-ctx"] = h + payload(i, h, 0.002, rng)
    for i, spread in ((0, 2), (6, 5), (17, 0)):  # across the chunk boundary (2 chunks)
        h = header(i, 8, 40000 + i, 3000 + i, spread)
        seeds[f"k{i:02d}-2chunks"] = h + payload(i, h, 0.0004, rng)
    h = header(0, 8, 32768, 4000)  # exactly one full chunk
    seeds["k00-fullchunk"] = h + payload(0, h, 0.0003, rng)
    for dens, name in ((1.0, "all"), (0.7, "most"), (0.5, "half")):  # complement coding
        h = header(4, 0, 200, 5000)
        seeds[f"k04-{name}"] = h + payload(4, h, dens, rng)
    h = header(1, 0, 0, 6000)  # a single element
    seeds["k01-one"] = h + payload(1, h, 1.0, rng)
    good = seeds["k00-small"]
    seeds["edge-empty-chunk"] = good[:8] + b"\x00"
    seeds["edge-no-payload"] = good[:8]
    seeds["edge-truncated"] = good[:-3]
    seeds["edge-long-varint"] = good[:8] + b"\xff" * 9 + b"\x01"
    h = header(0, 8, 40000, 3000, 2)  # two chunks, the first unchanged
    seeds["edge-2chunks-first-empty"] = h + payload(0, h, 0.002, rng, lo=CHUNK)
    for name, data in seeds.items():
        (out / "decode" / name).write_bytes(data)
    for i in range(len(kinds)):  # round trip: density, style, then 8-byte edits (each op)
        edits = b"".join(
            bytes([(37 * j + i) & 0xFF, j, 0, op | 8 * (j & 1)])
            + rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
            for j, op in enumerate(range(8))
        )
        cls = (0, 4, 6)[i % 3]
        rt = header(i, cls, 500 + i, 7000 + i, spread=i % 4)
        (out / "roundtrip" / f"k{i:02d}").write_bytes(rt + bytes([40 + i, i * 11]) + edits)
    (out / "roundtrip" / "k00-2chunks").write_bytes(header(0, 8, 40000, 8000, 2) + b"\x03\x02")
    (out / "roundtrip" / "k06-dense").write_bytes(header(6, 0, 900, 8100) + b"\xf0\x81")
    total = sum(f.stat().st_size for t in TARGETS for f in (out / t).iterdir())
    log(
        f"seed corpus: {sum(1 for t in TARGETS for _ in (out / t).iterdir())} files, "
        f"{total} bytes in {out}"
    )
