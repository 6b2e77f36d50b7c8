"""``-o`` of cast, diff, apply and pull never replaces what it must not (an audit, session 41,
H-F1): one of the command's own inputs (a checkpoint, a shard or index of an input folder, a
patch, a board object), a symlink, a device node or a FIFO. One line, exit 2, before any
work; an existing regular file that is not an input is still replaced."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollpatch.cli import EXIT_REFUSED, main
from rollpatch.io import load_view, save_view
from rollpatch.view import Tensor, View
from tests.conftest import masters


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *said: str) -> str:
    assert main(argv) == EXIT_REFUSED
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollpatch: error: "), lines
    for s in said:
        assert s in lines[0], lines[0]
    return lines[0]


def test_output_that_is_an_input_is_refused(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = ckpts
    before = old.read_bytes(), new.read_bytes()
    _refused(capsys, ["cast", str(old), "-o", str(old)], "is an input of this command")
    _refused(capsys, ["diff", str(old), str(new), "-o", str(old)], "is an input")
    _refused(capsys, ["diff", str(old), str(new), "-o", str(new)], "is an input")
    os.link(old, tmp_path / "hard.safetensors")  # the same file under another name
    _refused(capsys, ["cast", str(old), "-o", str(tmp_path / "hard.safetensors")], "is an input")
    # the same file through another spelling of its path
    _refused(capsys, ["cast", str(old), "-o", str(tmp_path / "." / old.name)], "is an input")
    assert (old.read_bytes(), new.read_bytes()) == before

    view, patch = tmp_path / "v.safetensors", tmp_path / "p.rpatch"
    assert main(["cast", str(old), "-o", str(view)]) == 0
    assert main(["diff", str(old), str(new), "-o", str(patch)]) == 0
    kept = view.read_bytes(), patch.read_bytes()
    _refused(capsys, ["apply", str(view), str(patch), "-o", str(patch)], "is an input")
    _refused(capsys, ["apply", str(view), str(patch), "-o", str(view)], "is an input")
    argv = ["cast", str(new), "--scales", "frozen", "--previous", str(view), "-o", str(view)]
    _refused(capsys, argv, "is an input")
    assert (view.read_bytes(), patch.read_bytes()) == kept

    # an existing regular file that is no input is replaced, as before
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"old content")
    assert main(["apply", str(view), str(patch), "-o", str(other)]) == 0
    want = tmp_path / "want.safetensors"
    assert main(["cast", str(new), "-o", str(want)]) == 0
    assert load_view(other).digest() == load_view(want).digest()


def test_output_that_is_a_shard_or_index_of_an_input_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    m = masters(1)
    names = sorted(m)
    shards = {n: f"model-0000{i + 1}-of-0000{len(names)}.safetensors" for i, n in enumerate(names)}
    for n, f in shards.items():
        save_view(View({n: Tensor.from_array(m[n])}), folder / f)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": shards}))
    shard = folder / shards[names[0]]
    before = shard.read_bytes(), index.read_bytes()
    line = _refused(capsys, ["cast", str(folder), "-o", str(shard)], "is an input")
    assert str(folder) in line
    _refused(capsys, ["cast", str(folder), "-o", str(index)], "is an input")
    _refused(capsys, ["diff", str(folder), str(folder), "-o", str(shard)], "is an input")
    assert (shard.read_bytes(), index.read_bytes()) == before
    assert main(["cast", str(folder), "-o", str(folder / "view.safetensors")]) == 0


def test_output_that_is_a_symlink_fifo_or_device_is_refused(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    old, _ = ckpts
    target = tmp_path / "target"
    target.write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(target)
    line = _refused(capsys, ["cast", str(old), "-o", str(link)], "symbolic link")
    assert "give the link's target instead" in line and str(target) in line
    assert link.is_symlink() and target.read_text() == "precious"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused(capsys, ["cast", str(old), "-o", str(fifo)], "is a FIFO")
    assert fifo.is_fifo()
    # a device node that exists on every Linux machine: refused before anything is written
    _refused(capsys, ["cast", str(old), "-o", "/dev/null"], "character device")
    assert Path("/dev/null").is_char_device()
    # through the link's target it works
    assert main(["cast", str(old), "-o", str(target)]) == 0
    assert link.is_symlink() and load_view(link).digest() == load_view(target).digest()


def test_pull_output_inside_the_board_or_through_a_link_is_refused(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    old, _ = ckpts
    board = tmp_path / "board"
    assert main(["publish", "--board", str(board), "--run", "r", str(old)]) == 0
    capsys.readouterr()
    objects = sorted((board / "runs" / "r" / "objects").iterdir())
    assert objects
    kept = objects[0].read_bytes()
    pull = ["pull", "--board", str(board), "--run", "r", "-o"]
    _refused(capsys, [*pull, str(objects[0])], "inside the board")
    assert objects[0].read_bytes() == kept
    link = tmp_path / "plink"
    link.symlink_to(tmp_path / "somewhere.safetensors")
    _refused(capsys, [*pull, str(link)], "symbolic link")
    assert main([*pull, str(tmp_path / "v.safetensors")]) == 0


def test_pull_and_root_never_write_over_their_trust_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A re-check (session 41): `pull --trust root.json -o root.json` replaced the trust root
    with the pulled view, and `--trust-state S -o S` the rollback state (the next pull's hint
    then said to delete it); `root ... -o KEY.pub --force` its own public key."""
    from tests.conftest import signing_world

    world = signing_world(tmp_path, "pub")
    publish = ["publish", str(world.ckpt), "--board", world.board, "--run", "r1"]
    assert main([*publish, "--signing-key", str(world.key)]) == 0
    state = tmp_path / "state.json"
    pull = ["pull", "--board", world.board, "--run", "r1", "--trust", str(world.root)]
    assert main([*pull, "--trust-state", str(state), "-o", str(tmp_path / "v.st")]) == 0
    capsys.readouterr()
    kept = {p: p.read_bytes() for p in (world.root, state, world.pub)}
    _refused(capsys, [*pull, "--trust-state", str(state), "-o", str(world.root)], "input")
    _refused(capsys, [*pull, "--trust-state", str(state), "-o", str(state)], "input")
    root = ["root", "--key", str(world.pub), "--sign", str(world.key), "--force", "-o"]
    _refused(capsys, [*root, str(world.pub)], "input")
    assert {p: p.read_bytes() for p in kept} == kept
