"""``rollpatch pull``: a verified round trip, and exit 2 with one line (no traceback) when
there is no way to the version or LATEST is bad. The published board: tests/followfix.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpatch.board import Board
from rollpatch.cli import main
from rollpatch.io import load_view
from tests.followfix import LAST, RUN, Published, published, set_latest

_FIXTURES = (published,)  # used by name


@pytest.fixture
def board(published: Published, tmp_path: Path) -> Board:
    """A private copy of the published board in a directory (the CLI refuses memory://)."""
    dst = Board(f"file://{tmp_path / 'board'}")
    for k in published.store.list(""):
        dst.store.put(k, published.store.get(k))
    return dst


def test_cli_pull_round_trip(board: Board, published: Published, tmp_path, capsys) -> None:
    uri = board.store.uri
    out = tmp_path / "v.safetensors"
    assert main(["pull", "--board", uri, "--run", RUN, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "plan rl" in text and "keyframe 20" in text and "(verified)" in text
    got = load_view(out)
    assert got.digest() == published.views[LAST].digest()
    assert main(["pull", "--board", uri, "--run", RUN, "--version", "8", "-o", str(out)]) == 0
    assert load_view(out).digest() == published.views[8].digest()


def test_cli_pull_refuses_with_exit_2(board: Board, tmp_path, capsys) -> None:
    for k in board.keyframes(RUN):  # every keyframe corrupt: no way around
        for obj in board.manifest(RUN, k).keyframes:
            data = bytearray(board.store.get(obj.ref.key))
            data[-1] ^= 1
            board.store.put(obj.ref.key, bytes(data), if_absent=False)
    out = tmp_path / "v.safetensors"
    code = main(
        ["pull", "--board", board.store.uri, "--run", RUN, "--retries", "0", "-o", str(out)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    # one line per corrupt object it planned around (warnings), then the error, no traceback
    assert err[-1].startswith("rollpatch: error:") and "corrupt" in err[-1]
    planned = [ln for ln in err[:-1] if "verification is OFF" not in ln]  # once per process
    assert planned and all(
        ln.startswith("rollpatch: WARNING ") and "corrupt; planning around it" in ln
        for ln in planned
    ), err


def test_cli_pull_bad_latest_exits_2_with_one_line(board: Board, tmp_path, capsys) -> None:
    out = tmp_path / "v.safetensors"
    for raw in (10**12, b'{"run": "rl", "version": 1e400}', b"[" * 100_000):
        set_latest(board, raw)
        code = main(["pull", "--board", board.store.uri, "--run", RUN, "-o", str(out)])
        lines = capsys.readouterr().err.strip().splitlines()
        # one error line; the warnings before it (once per process: verification is OFF)
        # come with their level (rollpatch.cli.console)
        err = [ln for ln in lines if not ln.startswith("rollpatch: WARNING ")]
        assert code == 2 and not out.exists()
        assert len(err) == 1 and err[0].startswith("rollpatch: error:"), lines
        if isinstance(raw, int):  # it says LATEST is the problem, not just "no such version"
            assert f"LATEST names version {raw}, which has no manifest" in err[0], err


def test_status_warns_when_latest_names_no_manifest(board: Board, capsys) -> None:
    set_latest(board, 10**6)
    assert main(["status", "--board", board.store.uri, "--run", RUN]) == 0
    out, err = capsys.readouterr()
    assert "LATEST 1000000" in out and "LATEST names version 1000000, which has no manifest" in err


def test_pull_of_a_version_not_on_the_board_says_what_the_run_has(
    board: Board, tmp_path, capsys
) -> None:
    """A version gc removed, or one not published yet: the error lists what the run has."""
    from rollpatch.board import version_key

    board.store.delete(version_key(RUN, 1))  # as retention would
    out = tmp_path / "v.safetensors"
    for want, why in ((1, "removed by retention"), (LAST + 5, "not published yet")):
        code = main(
            [
                "pull",
                "--board",
                board.store.uri,
                "--run",
                RUN,
                "--version",
                str(want),
                "-o",
                str(out),
            ]
        )
        err = capsys.readouterr().err
        assert code == 2 and f"version {want} is not on the board" in err and why in err, err
        assert f"the run has versions 0..{LAST}" in err, err
