"""bench/codec.py at a small size: one transition of one format measured end to end, every
round trip checked by the bench itself; the encode's memory is measured on a trimmed heap and
a process's one-time state is printed apart from the rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _util import trim_heap
from codec import main

from rollpatch import native

pytestmark = pytest.mark.skipif(native.core is None, reason="native core not built")


def test_small_run_prints_rows_and_one_time_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "codec.json"
    args = ["--sizes", "20M", "--lrs", "1e-5", "--steps", "1", "--repeats", "1"]
    args += ["--threads", "1", "--formats", "bf16", "--numpy-max", "0", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "a process's first encodes set up" in printed
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert row["patch_bytes"] > 0 and row["enc_extra"] > 0
    assert got["machine"]["first_encode_rss"] >= 0


def test_trim_heap_on_glibc() -> None:
    # Linux CI runs glibc: the trim is there, so the memory column is not silently untrimmed
    if sys.platform.startswith("linux"):
        assert trim_heap() is True


def test_big_view_path_runs_in_place_with_repeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the path for views too large for a third copy (in place, the inverse patch puts the base
    # back; memcpy into reused per-thread buffers), here at 20M with --big-repeats 2
    import _codec_transition

    monkeypatch.setattr(_codec_transition, "ONE_RUN_ABOVE", 0)
    out = tmp_path / "codec.json"
    args = ["--sizes", "20M", "--lrs", "1e-5", "--steps", "1", "--big-repeats", "2"]
    args += ["--threads", "2", "--formats", "bf16", "--numpy-max", "0", "--json", str(out)]
    assert main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["patch_bytes"] > 0 and row["threads"] == 2
