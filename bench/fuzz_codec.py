"""Coverage-guided fuzzing of the native codec core with libFuzzer, ASan and UBSan.

Run: ``python bench/fuzz_codec.py`` (600 s per target), e.g. ``--seconds 20`` in CI;
``--source-coverage`` adds llvm-cov's line/region coverage of the core (``CORE``) by the corpora;
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
import runpy
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fuzz_corpus import FUZZ, NATIVE, ROOT, SEEDS, TARGETS, make_corpus
from _util import log, table

WORK = ROOT / "build" / "fuzz"
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
# The native core's files and their internal headers, named once in native/sources.py (setup.py
# builds the same ones, with the CPython binding's files; the headers hold static inline helpers: bit streams,
# keys, block primitives).
_SOURCES = runpy.run_path(str(NATIVE / "sources.py"))
CORE = tuple(NATIVE / f"{f}.c" for f in _SOURCES["CORE"])
CORE_HEADERS = tuple(NATIVE / h for h in _SOURCES["INTERNAL_HEADERS"])


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
    """Compile both targets (and the core once per target) into ``work``; returns target ->
    binary."""
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
        core = _core_objects(clang, flags, work, t)
        out[t] = work / f"fuzz_{t}"
        _cc(
            [
                clang,
                *flags,
                "-Wall",
                "-Wno-unused-function",
                str(FUZZ / f"fuzz_{t}.c"),
                *core,
                "-o",
                str(out[t]),
            ]
        )
    return out


def _core_objects(clang: str, flags: list[str], work: Path, tag: str) -> list[str]:
    """Each core file compiled with cpu_switch.h force-included (the harness picks AVX2 or
    scalar per call); returns the object paths."""
    objs = []
    for src in CORE:
        obj = work / f"{src.stem}_{tag}.o"
        _cc([clang, *flags, "-include", str(FUZZ / "cpu_switch.h"), "-c", str(src), "-o", str(obj)])
        objs.append(str(obj))
    return objs


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
    source-coverage build; llvm-cov's line/region/function totals over the core's files
    (``CORE`` and ``CORE_HEADERS``) alone."""
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
        b, core = work / f"cov_{t}", _core_objects(clang, flags, work, "cov")
        _cc([clang, *flags, str(FUZZ / f"fuzz_{t}.c"), *core, "-o", str(b)])
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
            *(str(s) for s in (*CORE, *CORE_HEADERS)),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    for r in raws:
        Path(r).unlink()
    return p.stdout.strip()


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
        help="after the runs, the core's line/region coverage of the corpora",
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
