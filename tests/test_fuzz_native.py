"""The native decoder under libFuzzer with ASan and UBSan: a short campaign per target.

The long campaign is ``python bench/fuzz_codec.py`` (docs/patch-format.md §8); this runs the
same build for ~20 s per target (both targets at once) from the committed seed corpus, and
checks that the seeds still decode (the harness derives each seed's base from its header; a
change on either side would silently turn every real payload into a base mismatch). clang comes from
``scripts/fuzz-env``; when it cannot be installed the tests fail and say so: a skipped fuzz
run would look like a clean one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "fuzz_codec.py"
SEEDS = ROOT / "src" / "rollpatch" / "native" / "fuzz" / "corpus"
SECONDS = int(os.environ.get("ROLLPATCH_FUZZ_SECONDS", "20"))


@dataclass
class Fuzzers:
    """The built targets (``fuzz_<target>`` in ``work``) and bench/fuzz_codec.py's module."""

    work: Path
    binaries: dict[str, Path]
    bench: ModuleType


@pytest.fixture(scope="module")
def fuzzers(tmp_path_factory: pytest.TempPathFactory) -> Fuzzers:
    """clang installed (scripts/fuzz-env) and both targets built; the work directory."""
    env = subprocess.run(
        [str(ROOT / "scripts" / "fuzz-env")], check=False, capture_output=True, text=True
    )
    if env.returncode:
        pytest.fail(
            f"clang with libFuzzer is not available and scripts/fuzz-env could not "
            f"install it:\n{env.stderr.strip()}",
            pytrace=False,
        )
    work = tmp_path_factory.mktemp("fuzz")
    sys.path.insert(0, str(BENCH.parent))
    try:
        import fuzz_codec
    finally:
        sys.path.remove(str(BENCH.parent))
    return Fuzzers(work, fuzz_codec.build(work), fuzz_codec)


def test_seed_corpus_is_small_and_decodes(fuzzers: Fuzzers) -> None:
    files = sorted((SEEDS / "decode").iterdir())
    assert (
        sum(f.stat().st_size for t in ("decode", "roundtrip") for f in (SEEDS / t).iterdir())
        < 200_000
    )
    p = subprocess.run(
        [str(fuzzers.binaries["decode"]), *map(str, files)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "FZ_VERBOSE": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    outcomes = re.findall(r"Running: (\S+)\n(?:.*\n)*?fz: .* rc=(-?\d+) changed=(\d+)", p.stderr)
    got = {Path(name).name: (int(rc), int(k)) for name, rc, k in outcomes}
    assert set(got) == {f.name for f in files}
    for name, (rc, k) in got.items():
        if name.startswith("k"):  # real payloads: decode, with changes
            assert rc == 0 and k > 0, (
                f"seed {name} no longer decodes (rc={rc}): regenerate "
                f"with `python bench/fuzz_codec.py --make-corpus`"
            )
    assert got["edge-truncated"][0] == got["edge-no-payload"][0] == -2  # corrupt, refused
    assert got["edge-empty-chunk"] == (0, 0)


def test_short_fuzz_campaign(fuzzers: Fuzzers) -> None:
    """~20 s per target: no crash, leak, timeout or sanitizer report; real coverage.

    bench/fuzz_codec.py's own campaign (``run``: one libFuzzer process per target, its final
    stats and artifacts parsed) on the binaries the fixture built, both targets at once: one
    core each, so the campaign takes ~20 s of wall time, not 40, at the same length per target.
    """
    targets = fuzzers.bench.TARGETS
    with ThreadPoolExecutor(len(targets)) as pool:
        runs = {
            t: pool.submit(fuzzers.bench.run, t, fuzzers.binaries[t], SECONDS, fuzzers.work)
            for t in targets
        }
        results = {t: f.result() for t, f in runs.items()}
    assert set(results) == {"decode", "roundtrip"}
    for t, r in results.items():
        log = (fuzzers.work / f"{t}.log").read_text(errors="replace")
        tail = "\n".join(log.splitlines()[-60:])
        assert r.crashes == 0, f"fuzzing found a bug in {t}: {r.reproducers}\n{tail}"
        assert r.executions > 100 and r.cov > 300, (r, tail)


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_decode_threads_do_not_leak() -> None:
    import threading

    import numpy as np

    from rollpatch import native
    from rollpatch.kinds import KINDS

    core = native.require()
    n = 1 << 20
    a = np.random.default_rng(0).integers(0, 1 << 16, n, dtype=np.uint16)
    b = a.copy()
    b[::997] ^= 1
    kt = native.kind_tuple(KINDS["bf16"], n)
    [(body, k)], _, _ = core.encode_range(kt, a, b, 0, 1)
    head, v = bytearray(), len(body)
    while v >= 0x80:
        head.append(v & 0x7F | 0x80)
        v >>= 7
    payload = bytes(head) + bytes([v]) + body

    def decode() -> None:
        pos, old, new = np.empty(k, np.int64), np.empty(k, np.uint16), np.empty(k, np.uint16)
        core.decode_range(kt, a, payload, 0, 1, [k], [0], pos, old, new)
        assert np.array_equal(pos, np.flatnonzero(a != b))

    decode()
    before = _rss_kb()
    for _ in range(60):  # threads that end, as a ThreadPoolExecutor's do
        t = threading.Thread(target=decode)
        t.start()
        t.join()
    grown_mb = (_rss_kb() - before) / 1024
    assert grown_mb < 25, f"RSS grew {grown_mb:.0f} MB over 60 short-lived decoding threads"
