"""Coverage-guided fuzzing of the native codec core with libFuzzer, ASan and UBSan.

Run: ``python bench/fuzz_codec.py`` (600 s per target), e.g. ``--seconds 20`` in CI;
``--source-coverage`` adds llvm-cov's line/region coverage of rpcore.c by the corpora;
``--make-corpus`` rewrites the committed seed corpus. Needs clang with libFuzzer
(``scripts/fuzz-env`` installs it on Debian/Ubuntu).

**Targets** (src/rollpatch/native/fuzz/, docs/patch-format.md §8):

- *decode* (``fuzz_decode.c``): hostile payloads against a base derived from the input;
  chunk table, ``rp_chunk_count``, outputs sized from the counts, ``rp_decode_chunks`` with
  AVX2 and scalar loops (must agree); a payload that decodes must apply cleanly, keep the
  rp.sum128 change consistent and re-encode to the same changes.
- *roundtrip* (``fuzz_roundtrip.c``): a base and a perturbed target; the dense (AVX2 and
  scalar), sparse and records encoders must write identical bytes; the decode must equal the
  diff; ``rp_apply`` must reproduce the target; rp.sum128 must be additive.

Both are built with ``clang -g -O1 -fsanitize=fuzzer,address,undefined
-fno-sanitize-recover=undefined`` (the round trip without comparison tracing: ``EXTRA``)
into build/fuzz/ and run one at a time, one process each
(the machine's other cores stay free). Each run starts from the committed seeds plus what
earlier runs on this machine found (build/fuzz/corpus-TARGET/). The table reports libFuzzer's
final ``cov:`` (edges) and ``ft:`` (features), executions, exec/s, corpus and crashes; the
exit status is non-zero on any crash, leak, timeout or sanitizer report, and the reproducer
path is printed (replay: ``build/fuzz/fuzz_TARGET PATH``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "src" / "rollpatch" / "native"
FUZZ = NATIVE / "fuzz"
SEEDS = FUZZ / "corpus"
WORK = ROOT / "build" / "fuzz"
TARGETS = ("decode", "roundtrip")
CFLAGS = [
    "-g",
    "-O1",
    "-std=gnu11",
    "-fsanitize=fuzzer,address,undefined",
    "-fno-sanitize-recover=undefined",
]
# The round trip's input is never parsed by the core, so comparison tracing (what lets
# libFuzzer solve a parser's compares) buys nothing there and costs 2.5x in the coder's loops.
EXTRA = {"decode": [], "roundtrip": ["-fno-sanitize-coverage=trace-cmp"]}
CHUNK = 1 << 20

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import log, table


@dataclass
class Result:
    """One target's campaign, from libFuzzer's own output."""

    target: str
    seconds: float
    executions: int
    exec_per_s: int
    cov: int
    ft: int
    corpus: int
    crashes: int
    reproducers: list[str]


class FuzzSetupError(RuntimeError):
    """clang or libFuzzer is missing, or a target does not build."""


# ------------------------------------------------------------------ build


def build(work: Path = WORK) -> dict[str, Path]:
    """Compile both targets (and rpcore.c once) into ``work``; returns target -> binary."""
    clang = shutil.which("clang")
    if clang is None:
        raise FuzzSetupError(
            "clang not found: run scripts/fuzz-env (installs clang with "
            "libFuzzer), or install clang and libclang-rt-dev yourself"
        )
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for t in TARGETS:
        flags = [*CFLAGS, *EXTRA[t]]
        core = work / f"rpcore_{t}.o"
        _cc(
            [
                clang,
                *flags,
                "-include",
                str(FUZZ / "cpu_switch.h"),
                "-c",
                str(NATIVE / "rpcore.c"),
                "-o",
                str(core),
            ]
        )
        out[t] = work / f"fuzz_{t}"
        _cc(
            [
                clang,
                *flags,
                "-Wall",
                "-Wno-unused-function",
                str(FUZZ / f"fuzz_{t}.c"),
                str(core),
                "-o",
                str(out[t]),
            ]
        )
    return out


def _cc(cmd: list[str]) -> None:
    p = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if p.returncode:
        hint = (
            " (libFuzzer is missing: install libclang-rt-dev, or run scripts/fuzz-env)"
            if "libclang_rt.fuzzer" in p.stderr
            else ""
        )
        raise FuzzSetupError(f"build failed{hint}: {' '.join(cmd)}\n{p.stderr.strip()}")


# ------------------------------------------------------------------ run


def run(target: str, binary: Path, seconds: int, work: Path = WORK, max_len: int = 65536) -> Result:
    """Fuzz one target for ``seconds`` (one process); parse libFuzzer's final stats."""
    corpus = work / f"corpus-{target}"
    arts = work / "artifacts" / target
    corpus.mkdir(parents=True, exist_ok=True)
    arts.mkdir(parents=True, exist_ok=True)
    before = set(arts.iterdir())
    cmd = [
        str(binary),
        str(corpus),
        str(SEEDS / target),
        f"-max_total_time={seconds}",
        "-print_final_stats=1",
        f"-max_len={max_len}",
        "-timeout=30",
        "-rss_limit_mb=2048",
        f"-artifact_prefix={arts}/",
    ]
    log(f"fuzz {target}: {seconds} s ({' '.join(cmd)})")
    t0 = time.monotonic()
    p = subprocess.run(
        cmd, check=False, capture_output=True, text=True, errors="replace", timeout=seconds + 300
    )
    wall = time.monotonic() - t0
    (work / f"{target}.log").write_text(p.stderr)
    new = sorted(
        str(a)
        for a in set(arts.iterdir()) - before  # slow-unit-*: not a failure
        if a.name.startswith(("crash-", "leak-", "timeout-", "oom-"))
    )
    crashed = p.returncode != 0 or bool(new)
    if crashed:
        tail = "\n".join(p.stderr.splitlines()[-40:])
        print(
            f"--- fuzz_{target} exited {p.returncode}; last lines of {work / target}.log:\n{tail}",
            file=sys.stderr,
        )
    return Result(
        target,
        round(wall, 1),
        _stat(p.stderr, "number_of_executed_units"),
        _stat(p.stderr, "average_exec_per_sec"),
        *_cov(p.stderr),
        sum(1 for _ in corpus.iterdir()),
        len(new) or int(crashed),
        new,
    )


def _stat(text: str, name: str) -> int:
    m = re.findall(rf"stat::{name}:\s*(\d+)", text)
    return int(m[-1]) if m else 0


def _cov(text: str) -> tuple[int, int]:
    m = re.findall(r"cov: (\d+) ft: (\d+)", text)
    return (int(m[-1][0]), int(m[-1][1])) if m else (0, 0)


# ------------------------------------------------------------------ source coverage


def source_coverage(work: Path = WORK) -> str:
    """Replay both targets' corpora (seeds + what the runs found) through a clang
    source-coverage build; llvm-cov's line/region/function totals for rpcore.c alone."""
    tools = [shutil.which(t) for t in ("clang", "llvm-profdata", "llvm-cov")]
    if not all(tools):
        raise FuzzSetupError("source coverage needs clang, llvm-profdata and llvm-cov (llvm)")
    clang, profdata, cov = (str(t) for t in tools)
    flags = [
        "-g",
        "-O1",
        "-std=gnu11",
        "-fsanitize=fuzzer",
        "-fprofile-instr-generate",
        "-fcoverage-mapping",
    ]
    raws, bins = [], []
    for t in TARGETS:
        b, core = work / f"cov_{t}", work / "cov_rpcore.o"
        _cc(
            [
                clang,
                *flags,
                "-include",
                str(FUZZ / "cpu_switch.h"),
                "-c",
                str(NATIVE / "rpcore.c"),
                "-o",
                str(core),
            ]
        )
        _cc([clang, *flags, str(FUZZ / f"fuzz_{t}.c"), str(core), "-o", str(b)])
        dirs = [d for d in (work / f"corpus-{t}", SEEDS / t) if d.is_dir()]
        files = [str(f) for d in dirs for f in sorted(d.iterdir())]
        raw = work / f"cov_{t}.profraw"
        for i in range(0, len(files), 200):  # one process per batch: argv stays short
            subprocess.run(
                [str(b), "-runs=0", *files[i : i + 200]],
                check=False,
                capture_output=True,
                env={"LLVM_PROFILE_FILE": f"{raw}.{i}"},
            )
        raws += [str(r) for r in work.glob(f"cov_{t}.profraw.*")]
        bins.append(str(b))
    data = work / "cov.profdata"
    _cc([profdata, "merge", "-sparse", *raws, "-o", str(data)])
    p = subprocess.run(
        [
            cov,
            "report",
            bins[0],
            "-object",
            bins[1],
            f"-instr-profile={data}",
            str(NATIVE / "rpcore.c"),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    for r in raws:
        Path(r).unlink()
    return p.stdout.strip()


# ------------------------------------------------------------------ seed corpus


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


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--seconds",
        type=int,
        default=600,
        help="per target (default 600; 0: build only, e.g. with --source-coverage)",
    )
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated")
    ap.add_argument("--make-corpus", action="store_true", help="rewrite the seed corpus, exit")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument(
        "--source-coverage",
        action="store_true",
        help="after the runs, rpcore.c's line/region coverage of the corpora",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=WORK,
        help="binaries, the growing corpus, artifacts, logs (default build/fuzz)",
    )
    args = ap.parse_args(argv)
    if args.make_corpus:
        make_corpus()
        return 0
    targets = [t for t in args.targets.split(",") if t]
    if unknown := set(targets) - set(TARGETS):
        ap.error(f"unknown targets {sorted(unknown)}; choose from {TARGETS}")
    try:
        bins = build(args.work)
    except FuzzSetupError as e:
        print(f"fuzz_codec: {e}", file=sys.stderr)
        return 2
    results = [run(t, bins[t], args.seconds, args.work) for t in targets if args.seconds > 0]
    print(
        table(
            ["target", "seconds", "executions", "exec/s", "cov", "ft", "corpus", "crashes"],
            [
                [
                    r.target,
                    f"{r.seconds:.0f}",
                    str(r.executions),
                    str(r.exec_per_s),
                    str(r.cov),
                    str(r.ft),
                    str(r.corpus),
                    str(r.crashes),
                ]
                for r in results
            ],
            right=[False] + [True] * 7,
        )
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.source_coverage:
        print(source_coverage(args.work))
    bad = [r for r in results if r.crashes]
    for r in bad:
        for path in r.reproducers or [f"(no artifact: see {args.work / r.target}.log)"]:
            print(f"CRASH {r.target}: {path}  (replay: {args.work}/fuzz_{r.target} {path})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
