"""bench/codec_ab.py: two builds of the core loaded side by side in one process, alternated
over the same transition (here the built core twice), every apply checked; and a file that
is not a core refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from codec_ab import load_core, main

from rollpatch import native

pytestmark = pytest.mark.skipif(native.core is None, reason="native core not built")


_SMALL = ["--size", "1M", "--vocab", "512"]  # a 1M-parameter model, fast enough for a test


def test_two_builds_alternated(capsys: pytest.CaptureFixture[str]) -> None:
    so = native.core.__file__  # type: ignore[union-attr]
    before = native.core
    assert (
        main(
            [
                so,
                so,
                *_SMALL,
                "--lrs",
                "1e-5",
                "--threads",
                "1,2",
                "--reps",
                "3",
            ]
        )
        == 0
    )
    assert native.core is before  # put back
    out = capsys.readouterr().out
    blocks = out.strip().split("\n1M ")
    assert len(blocks) == 2  # T=1 and T=2
    for block in blocks:
        rows = block.splitlines()[1:]
        assert [r.split()[0] for r in rows] == ["0:_rpcore", "1:_rpcore", "xor1"]
        for r in rows:  # medians and minimums are measured times
            f = r.split()
            assert float(f[f.index("med") + 1]) > 0 and float(f[f.index("min") + 1]) > 0


def test_encode_timed_too(capsys: pytest.CaptureFixture[str]) -> None:
    so = native.core.__file__  # type: ignore[union-attr]
    assert (
        main(
            [
                so,
                *_SMALL,
                "--lrs",
                "1e-6",
                "--threads",
                "1",
                "--reps",
                "2",
                "--encode",
            ]
        )
        == 0
    )
    keys = [r.split()[0:2] for r in capsys.readouterr().out.splitlines()[1:]]
    assert keys == [["0:_rpcore", "wall"], ["0:_rpcore", "enc"], ["xor1", "wall"], ["xor1", "enc"]]


def test_not_a_core_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.so"
    bad.write_bytes(b"not an ELF file")
    with pytest.raises(ImportError):
        load_core(str(bad))
