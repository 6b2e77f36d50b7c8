"""CLI round trips: cast, diff, apply, inspect (in-process and as a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from rollpatch.cli import main
from rollpatch.formats import cast_view
from rollpatch.io import load_view, save_view
from rollpatch.view import View
from tests.conftest import masters, save_masters, signing_world


@pytest.mark.parametrize("fmt", ["bf16", "fp8-e4m3-block128", "nvfp4", "int4-g128"])
def test_cast_diff_apply_inspect(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    save_masters(old, masters(1))
    save_masters(new, masters(2, step=1e-3))
    assert main(["cast", str(old), "--format", fmt, "-o", str(tmp_path / "v0.safetensors")]) == 0
    assert main(["cast", str(new), "--format", fmt, "-o", str(tmp_path / "v1.safetensors")]) == 0
    patch = tmp_path / "p.rpatch"
    assert main(["diff", str(old), str(new), "--format", fmt, "-o", str(patch)]) == 0
    out = tmp_path / "out.safetensors"
    assert main(["apply", str(tmp_path / "v0.safetensors"), str(patch), "-o", str(out)]) == 0
    assert load_view(out).digest() == load_view(tmp_path / "v1.safetensors").digest()
    assert load_view(out).digest() == cast_view(masters(2, step=1e-3), fmt).digest()
    capsys.readouterr()
    assert main(["inspect", str(patch), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["target"] == load_view(out).digest() and info["changed"] > 0
    assert main(["inspect", str(patch)]) == 0
    assert "bytes by codec" in capsys.readouterr().out


def _diff_views(tmp_path: Path, a: View, b: View) -> Path:
    """Save ``a`` and ``b`` as a.safetensors and b.safetensors; ``rollpatch diff --views``
    writes their patch to ``p`` (returned)."""
    save_view(a, tmp_path / "a.safetensors")
    save_view(b, tmp_path / "b.safetensors")
    out = tmp_path / "p"
    argv = ["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    assert main([*argv, "--views", "-o", str(out)]) == 0
    return out


def test_diff_of_views(tmp_path: Path) -> None:
    a = cast_view(masters(1), "bf16")
    b = cast_view(masters(3, step=1e-3), "bf16")
    _diff_views(tmp_path, a, b)
    assert (
        main(
            [
                "apply",
                str(tmp_path / "a.safetensors"),
                str(tmp_path / "p"),
                "-o",
                str(tmp_path / "o.safetensors"),
            ]
        )
        == 0
    )
    assert load_view(tmp_path / "o.safetensors").digest() == b.digest()


def test_apply_refuses_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = cast_view(masters(1), "bf16")
    b = cast_view(masters(4, step=1e-3), "bf16")
    c = cast_view(masters(5, step=1e-3), "bf16")
    for name, v in (("a", a), ("b", b), ("c", c)):
        save_view(v, tmp_path / f"{name}.safetensors")
    assert (
        main(
            [
                "diff",
                str(tmp_path / "b.safetensors"),
                str(tmp_path / "c.safetensors"),
                "--views",
                "-o",
                str(tmp_path / "bc"),
            ]
        )
        == 0
    )
    out = tmp_path / "out.safetensors"
    assert (
        main(["apply", str(tmp_path / "a.safetensors"), str(tmp_path / "bc"), "-o", str(out)]) == 2
    )
    assert "not this patch's base" in capsys.readouterr().err
    assert not out.exists()
    blob = bytearray((tmp_path / "bc").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (tmp_path / "bad").write_bytes(bytes(blob))
    assert (
        main(["apply", str(tmp_path / "b.safetensors"), str(tmp_path / "bad"), "-o", str(out)]) == 2
    )
    assert not out.exists()


def test_torch_checkpoint_input(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="the torch extra is installed in CI")
    ms = masters(1)
    sd = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in ms.items()}
    torch.save(sd, tmp_path / "m.pt")
    assert main(["cast", str(tmp_path / "m.pt"), "-o", str(tmp_path / "v.safetensors")]) == 0
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in ms.items()}
    assert load_view(tmp_path / "v.safetensors").digest() == cast_view(bf, "bf16").digest()


def test_console_script_subprocess(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollpatch",
            "inspect",
            str(Path(__file__).parent / "golden" / "v1" / "step.rpatch"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "rp.ctxgolomb.v1" in res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "rollpatch", "inspect", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 2 and "patch not found" in res.stderr and "Traceback" not in res.stderr


# -- hostile input (issue 11) -------------------------------------------------------------------


def test_inspect_escapes_control_characters_in_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = "w\x1b]0;pwned\x07\x1b[2J\u2028"
    a = cast_view({evil: masters(1)["model.embed_tokens.weight"]}, "bf16")
    b = cast_view({evil: masters(6, step=1e-2)["model.embed_tokens.weight"]}, "bf16")
    _diff_views(tmp_path, a, b)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u2028" not in out
    assert "w\\x1b]0;pwned\\x07\\x1b[2J\\u2028" in out
    assert main(["inspect", str(tmp_path / "p"), "--json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and json.loads(out)["tensors"][0]["name"] == evil


def test_key_files_are_read_the_same_way_everywhere(tmp_path: Path) -> None:
    from rollpatch.cli.secrets import read_secret, read_token
    from rollpatch.errors import ConfigError

    for name, raw in (("plain", b"s3cret"), ("newline", b"s3cret\n"), ("crlf", b"  s3cret\r\n")):
        (tmp_path / name).write_bytes(raw)
        assert read_secret(str(tmp_path / name)) == b"s3cret"
        assert read_token(str(tmp_path / name)) == "s3cret"
    (tmp_path / "empty").write_bytes(b" \n")
    (tmp_path / "binary").write_bytes(b"\xff\x00tok")
    for bad, call in (("empty", read_secret), ("missing", read_secret), ("binary", read_token)):
        with pytest.raises(ConfigError):
            call(str(tmp_path / bad))


def test_pull_and_publish_share_the_key_file_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world = signing_world(tmp_path, "pub")
    board, key, root, ckpt = world.board, world.key, world.root, world.ckpt
    key.write_bytes(b"\n  " + key.read_bytes() + b"\r\n")  # surrounding whitespace: ignored
    root.write_bytes(root.read_bytes() + b"\n\n")
    assert (
        main(["publish", str(ckpt), "--board", board, "--run", "r1", "--signing-key", str(key)])
        == 0
    )
    assert (
        main(
            [
                "pull",
                "--board",
                board,
                "--run",
                "r1",
                "--trust",
                str(root),
                "--trust-state",
                str(tmp_path / "state.json"),
                "-o",
                str(tmp_path / "out.safetensors"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    root.write_bytes(b"\n")
    assert (
        main(
            [
                "pull",
                "--board",
                board,
                "--run",
                "r1",
                "--trust",
                str(root),
                "-o",
                str(tmp_path / "out2.safetensors"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trust root" in err[0], err


@pytest.mark.parametrize(
    "header", [b"[" * 100_000, b'{"w": {"dtype": {"a": 1}}}', b'{"\\ud800": 1}', b'{"a": NaN}']
)
def test_bad_safetensors_input_exits_2_with_one_line(
    tmp_path: Path, header: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header)
    good = tmp_path / "good.safetensors"
    save_view(cast_view(masters(1), "bf16"), good)
    for argv in (
        ["diff", str(bad), str(good), "--views", "-o", str(tmp_path / "p")],
        ["cast", str(bad), "-o", str(tmp_path / "v")],
        ["publish", str(bad), "--board", f"file://{tmp_path / 'b'}", "--run", "r1"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rollpatch: error:"), (argv, err)


def test_resign_keeps_a_cli_published_latest_alive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rollpatch publish` exits, so nothing re-signs LATEST: once it expired, followers with
    --trust refuse the board; `rollpatch resign` re-signs it for the version it names."""
    import time

    from rollpatch.board import Board
    from rollpatch.errors import TrustError
    from rollpatch.trust import Trust

    world = signing_world(tmp_path, "pub")
    sign = ["--signing-key", str(world.key)]
    publish = ["publish", str(world.ckpt), "--board", world.board, "--run", "r1"]
    assert main([*publish, *sign, "--latest-ttl", "1"]) == 0
    time.sleep(1.5)
    trust = Trust.from_file(world.root, state_path=tmp_path / "s.json", board=world.board)
    with pytest.raises(TrustError, match="expired"):
        Board(world.board, trust=trust).latest("r1")
    capsys.readouterr()
    assert main(["resign", "--board", world.board, "--run", "r1", *sign]) == 0
    assert "r1@0: LATEST re-signed, valid until" in capsys.readouterr().out
    assert Board(world.board, trust=trust).latest("r1").version == 0
    assert main(["resign", "--board", world.board, "--run", "nope", *sign]) == 2
    assert "has no LATEST to re-sign" in capsys.readouterr().err
    assert main(["resign", "--board", world.board, "--run", "r1"]) == 2  # no key


def test_status_with_a_trust_root_verifies_and_marks_what_it_refuses(
    tmp_path: Path, capsys
) -> None:
    """``rollpatch status --trust ROOT``: every manifest verified; a forged one is a row marked
    refused (the others still listed) and exit 2 with one line on stderr."""
    from rollpatch.board import Board
    from rollpatch.layout import version_key

    world = signing_world(tmp_path, "pub")
    sign = ["--signing-key", str(world.key)]
    publish = ["publish", str(world.ckpt), "--board", world.board, "--run", "r1", *sign]
    for _ in range(3):
        assert main(publish) == 0
    trusted = ["--trust", str(world.root), "--trust-state", str(tmp_path / "s.json")]
    status = ["status", "--board", world.board, "--run", "r1"]
    capsys.readouterr()
    assert main([*status, *trusted]) == 0
    out = capsys.readouterr().out
    assert "verified under the trust root" in out and "refused" not in out
    board = Board(world.board)
    raw = json.loads(board.store.get(version_key("r1", 1)))
    raw["target"] = "0" * 64  # forged: the signature no longer covers it
    board.store.put(version_key("r1", 1), json.dumps(raw).encode(), if_absent=False)
    assert main([*status, *trusted]) == 2
    got = capsys.readouterr()
    assert got.err.strip().splitlines()[-1].startswith("rollpatch: error: 1 manifest refused")
    rows = [ln.split() for ln in got.out.splitlines() if ln.startswith("  ")]
    assert [r[0] for r in rows[1:]] == ["0", "1", "2"] and rows[2][1] == "refused:"
    assert main([*status, *trusted, "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] and doc["runs"][0]["n_refused"] == 1
    assert "TrustError" in doc["runs"][0]["versions"][1]["refused"]


def test_diff_across_shapes_counts_what_is_shipped_whole(tmp_path: Path, capsys) -> None:
    """A reshaped tensor is not '0% changed': the line names it and its elements."""
    from safetensors.numpy import save_file

    save_file(
        {"a": np.ones((4, 8), np.float32), "b": np.ones(8, np.float32)}, str(tmp_path / "x.st")
    )
    save_file(
        {"a": np.full((8, 8), 1.5, np.float32), "b": np.ones(8, np.float32)}, str(tmp_path / "y.st")
    )
    out = tmp_path / "p.rpatch"
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "x.st"), str(tmp_path / "y.st"), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "0 of 40 elements changed in place (0.000%)" in said
    assert "1 tensor shipped whole (64 elements): added, reshaped or retyped" in said


def test_resign_with_a_key_that_did_not_publish_the_run_changes_nothing(
    tmp_path: Path, capsys
) -> None:
    """A cron job with the wrong key must not replace the publisher's LATEST (followers
    under the trust root would refuse the new one): refused, exit 2, LATEST byte for byte,
    whether the root does not list the key or lists it but it did not publish the run."""
    from rollpatch.board import Board
    from rollpatch.layout import pointer_key

    world = signing_world(tmp_path, "pub")
    assert main(["keygen", "-o", str(tmp_path / "other")]) == 0
    publish = ["publish", str(world.ckpt), "--board", world.board, "--run", "r1"]
    assert main([*publish, "--signing-key", str(world.key)]) == 0
    board = Board(world.board)
    before = board.store.get(pointer_key("r1"))
    capsys.readouterr()
    other = ["--signing-key", str(tmp_path / "other.key")]
    assert main(["resign", "--board", world.board, "--run", "r1", *other]) == 2
    assert "root of trust (version 1) does not list these keys" in capsys.readouterr().err
    # listed by the root (a second publisher's key), but not what published the run
    keys = ["--key", str(world.pub), "--key", str(tmp_path / "other.pub")]
    assert main(["root", "--board", world.board, *keys, "--sign", str(world.key)]) == 0
    capsys.readouterr()
    assert main(["resign", "--board", world.board, "--run", "r1", *other]) == 2
    err = capsys.readouterr().err
    assert "LATEST names r1@0, whose manifest none of these keys signed" in err
    assert "nothing re-signed" in err and "resign with the key the run is published with" in err
    assert board.store.get(pointer_key("r1")) == before
    resign = ["resign", "--board", world.board, "--run", "r1", "--signing-key", str(world.key)]
    assert main(resign) == 0
    capsys.readouterr()
    assert main([*resign, "--every", "600", "--latest-ttl", "10"]) == 2  # expired between
    assert "--every must be shorter than --latest-ttl" in capsys.readouterr().err


def test_status_with_a_trust_root_lists_a_run_whose_latest_expired(tmp_path: Path, capsys) -> None:
    """An expired LATEST is marked refused on its run's line (with the version it names);
    that run's manifests and the other runs are still listed; exit 2."""
    import time

    world = signing_world(tmp_path, "pub")
    sign = ["--signing-key", str(world.key)]
    base = ["publish", str(world.ckpt), "--board", world.board]
    assert main([*base, "--run", "stale", *sign, "--latest-ttl", "1"]) == 0
    assert main([*base, "--run", "ok", *sign]) == 0
    time.sleep(1.5)
    capsys.readouterr()
    trusted = ["--trust", str(world.root), "--trust-state", str(tmp_path / "s.json")]
    assert main(["status", "--board", world.board, *trusted]) == 2
    got = capsys.readouterr()
    assert "the LATEST of 1 run refused under the trust root" in got.err
    lines = got.out.splitlines()
    stale = next(ln for ln in lines if ln.startswith("run stale:"))
    assert "LATEST 0 (refused: TrustError: LATEST has expired" in stale
    assert any(ln.startswith("run ok: LATEST 0,") for ln in lines)
    assert sum("<- LATEST" in ln for ln in lines) == 2


def _published(tmp_path: Path, n: int) -> str:
    """A file:// board under ``tmp_path`` with ``n`` versions of run r1, published by the CLI."""
    board = f"file://{tmp_path / 'board'}"
    for v in range(n):
        ckpt = tmp_path / f"m{v}.safetensors"
        save_masters(ckpt, masters(1 + v))
        assert main(["publish", str(ckpt), "--board", board, "--run", "r1"]) == 0
    return board


def test_pull_writes_the_version_asked_for_or_nothing(tmp_path: Path, capsys) -> None:
    """An object on the way to the version asked for is corrupt: `pull` wrote the newest
    earlier version it could reach (the fallback a booting island takes), said "(verified)"
    and exited 0 (an audit's HIGH finding: `pull ... && deploy` shipped stale weights). Now
    it exits 2 and writes nothing, for `--version N` and for LATEST alike."""
    from rollpatch.board import Board

    board = _published(tmp_path, 3)
    b = Board(board)
    for ref in b.manifest("r1", 2).objects():
        raw = bytearray(b.store.get(ref.key))
        raw[len(raw) // 2] ^= 0x40
        b.store.put(ref.key, bytes(raw), if_absent=False)
    out = tmp_path / "out.safetensors"
    capsys.readouterr()
    for want in (["--version", "2"], []):
        assert main(["pull", "--board", board, "--run", "r1", *want, "-o", str(out)]) == 2
        err = capsys.readouterr().err  # (a log line may come first: another test's handler)
        assert err.splitlines()[-1].startswith("rollpatch: error:"), err
        assert "Traceback" not in err
        assert not out.exists()
    assert main(["pull", "--board", board, "--run", "r1", "--version", "1", "-o", str(out)]) == 0
    assert load_view(out).digest() == b.manifest("r1", 1).target


def test_pull_refuses_an_object_larger_than_its_manifest_entry_unread(
    tmp_path: Path, capsys
) -> None:
    """Anyone who can write to the store (no key needed: the manifest stays genuine) makes a
    patch object a sparse 64 GiB file: the follower read objects whole before it compared
    their size with the manifest's entry (an audit, session 40: a 4 GB one took 38 s and
    8.4 GB). Now it is refused unread, at once; so are a LATEST and a manifest over their
    documents' bounds."""
    import os

    from rollpatch.board import Board
    from rollpatch.errors import ManifestError
    from rollpatch.layout import pointer_key, version_key

    board = _published(tmp_path, 2)
    b = Board(board)
    root = tmp_path / "board"
    for ref in b.manifest("r1", 1).objects():
        os.truncate(root / ref.key, 64 << 30)
    out = tmp_path / "out.safetensors"
    capsys.readouterr()
    assert main(["pull", "--board", board, "--run", "r1", "-o", str(out), "--retries", "0"]) == 2
    err = capsys.readouterr().err
    assert "larger than it names; not read" in err and "got_bytes=68719476736" in err, err
    assert not out.exists()
    os.truncate(root / pointer_key("r1"), 1 << 30)
    os.truncate(root / version_key("r1", 0), 1 << 30)
    fresh = Board(board)
    with pytest.raises(ManifestError, match="larger than a LATEST pointer may be"):
        fresh.latest("r1")
    with pytest.raises(ManifestError, match="larger than a manifest may be"):
        fresh.manifest("r1", 0)


def test_resign_with_a_key_a_rotation_retired_changes_nothing(tmp_path: Path, capsys) -> None:
    """The planned rotation of docs/trust.md, then a resign timer left with the old key: its
    keys signed the dual-signed manifest LATEST names, so it re-signed LATEST, and every
    follower with --trust refused the board (an audit's HIGH finding). Now it is refused
    against the board's newest root, exit 2, LATEST byte for byte; the new key re-signs."""
    from rollpatch.board import Board
    from rollpatch.layout import pointer_key

    world = signing_world(tmp_path, "old")
    assert main(["keygen", "-o", str(tmp_path / "new")]) == 0
    old, new = ["--signing-key", str(world.key)], ["--signing-key", str(tmp_path / "new.key")]
    publish = ["publish", str(world.ckpt), "--board", world.board, "--run", "r1"]
    assert main([*publish, *old]) == 0
    save_masters(world.ckpt, masters(2))
    assert main([*publish, *old, *new, "--keyframe"]) == 0
    rotate = ["root", "--board", world.board, "--key", str(tmp_path / "new.pub")]
    assert main([*rotate, "--sign", str(world.key), "--sign", str(tmp_path / "new.key")]) == 0
    board = Board(world.board)
    before = board.store.get(pointer_key("r1"))
    capsys.readouterr()
    assert main(["resign", "--board", world.board, "--run", "r1", *old]) == 2
    err = capsys.readouterr().err
    assert "root of trust (version 2) does not list these keys" in err, err
    assert board.store.get(pointer_key("r1")) == before
    assert main(["resign", "--board", world.board, "--run", "r1", *new]) == 0


def test_sigterm_leaves_no_half_written_file(tmp_path: Path) -> None:
    """`timeout`, systemd and Kubernetes stop a command with SIGTERM: it had no handler, so a
    pull (cast, apply) killed mid-write left its hidden multi-hundred-MB temp file behind (an
    audit's MEDIUM finding, session 39). Now SIGTERM unwinds the command: the temp file is
    removed, OUT is not written, exit 143. (The write is slowed down here so that the signal
    lands in it.)"""
    import signal
    import time

    src = tmp_path / "m.safetensors"
    save_masters(src, masters(1))
    out = tmp_path / "out.safetensors"
    slow_cast = (
        "import sys, time\n"
        "import rollpatch.io.safetensors as st\n"
        "chunks = st.view_chunks\n"
        "def slow(view, metadata=None):\n"
        "    size, pieces = chunks(view, metadata)\n"
        "    def gen():\n"
        "        for p in pieces():\n"
        "            yield p\n"
        "            time.sleep(60)\n"
        "    return size, gen\n"
        "st.view_chunks = slow\n"
        "from rollpatch.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", slow_cast, "cast", str(src), "--format", "bf16", "-o", str(out)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.safetensors.tmp-*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "rollpatch: terminated" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors.tmp-*"))


def test_newcomer_polish(tmp_path: Path, capsys) -> None:
    """Small things a first-hour audit tripped over (session 39): an empty checkpoint is not
    cast (publish already refused it); a diff against an empty view prints no "% of the view"
    (it printed 128006700.000%); gc refuses a NaN grace (no orphan was ever old enough) and
    names its flags; a gateway --sidecar given as an OpenAI base URL (/v1) is the sidecar."""
    import torch

    from rollpatch.gateway.config import parse_island

    empty = tmp_path / "empty.pt"
    torch.save({}, empty)
    assert main(["cast", str(empty), "--format", "bf16", "-o", str(tmp_path / "e.st")]) == 2
    assert "holds no tensors: nothing to cast" in capsys.readouterr().err
    assert not (tmp_path / "e.st").exists()
    save_view(View({}), tmp_path / "nothing.safetensors")
    ckpt = tmp_path / "m.safetensors"
    save_masters(ckpt, masters(1))
    argv = ["diff", str(tmp_path / "nothing.safetensors"), str(ckpt), "-o", str(tmp_path / "p")]
    assert main([*argv, "--format", "bf16"]) == 0
    assert "% of the view" not in capsys.readouterr().out
    board = f"file://{tmp_path / 'board'}"
    assert main(["publish", str(ckpt), "--board", board, "--run", "r1"]) == 0
    capsys.readouterr()
    for bad in ("nan", "-1"):
        assert main(["gc", "--board", board, "--run", "r1", "--orphan-grace", bad]) == 2
        assert "--orphan-grace" in capsys.readouterr().err
    assert parse_island("a=http://h:8101/v1/").url == "http://h:8101"
    assert parse_island("http://h:8101/v1").url == "http://h:8101"


def test_an_output_that_cannot_be_written_is_said_before_the_work(tmp_path: Path, capsys) -> None:
    """A directory that takes no new file (here /sys/kernel, which refuses even root) is said
    at start, naming the option and the directory, for pull, cast and analyze --plot (an
    audit saw `[Errno 30] Read-only file system: 'ro/.x.safetensors.tmp-6887'` after a whole
    pull); a failed write names the file asked for, never the temp file, which is removed.
    `root -o` keeps an existing file (the followers' anchor) unless --force, and checks it
    before it puts anything on the board."""
    from rollpatch.board import Board
    from rollpatch.cli.codec import write_atomic

    unwritable = Path("/sys/kernel")
    assert unwritable.is_dir()
    board = f"file://{tmp_path / 'board'}"
    ckpt = tmp_path / "m.safetensors"
    save_masters(ckpt, masters(1))
    assert main(["publish", str(ckpt), "--board", board, "--run", "r1"]) == 0
    capsys.readouterr()
    out = str(unwritable / "x.safetensors")
    for argv in (
        ["pull", "--board", board, "--run", "r1", "-o", out],
        ["cast", str(ckpt), "--format", "bf16", "-o", out],
        ["analyze", str(ckpt), str(ckpt), "--plot", str(unwritable / "x.png")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "cannot write in /sys/kernel" in err, err
        assert ("--plot" if "--plot" in argv else "-o:") in err and "Traceback" not in err
    with pytest.raises(OSError) as info:
        write_atomic(unwritable / "r.json", b"{}")
    assert info.value.filename == str(unwritable / "r.json")
    assert main(["keygen", "-o", str(tmp_path / "k")]) == 0
    keys = ["--key", str(tmp_path / "k.pub"), "--sign", str(tmp_path / "k.key")]
    anchor = tmp_path / "root.json"
    anchor.write_text("the anchor handed to followers\n")
    capsys.readouterr()
    assert main(["root", "--board", board, *keys, "-o", str(anchor)]) == 2
    assert "root.json exists" in capsys.readouterr().err
    assert anchor.read_text() == "the anchor handed to followers\n"
    assert Board(board).roots() == []
    assert main(["root", "--board", board, *keys, "-o", str(anchor), "--force"]) == 0
    assert Board(board).roots() == [1] and anchor.read_bytes() == Board(board).root_raw(1) + b"\n"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_a_forged_root_on_the_board_is_named_with_the_fix(tmp_path: Path, capsys) -> None:
    """Anyone who can write to the store puts a self-signed root 2 there (an audit, session
    40): every `--trust` reader stopped with "root 2 is not signed by the previous root's
    keys", and the publisher's honest rotation failed the same way, neither saying that root
    2 is forged nor what to do. Both now name it and the fix; removing it restores both."""
    import os

    from rollpatch.board import Board
    from rollpatch.layout import root_key
    from rollpatch.trust import Root, read_public_key, read_signing_key, sign_root

    world = signing_world(tmp_path)
    publish = ["publish", str(world.ckpt), "--board", world.board, "--run", "r1"]
    assert main([*publish, "--signing-key", str(world.key)]) == 0
    assert main(["keygen", "-o", str(tmp_path / "evil")]) == 0
    evil = Root.new([read_public_key(tmp_path / "evil.pub")], threshold=1, version=2)
    Board(world.board).put_root(sign_root(evil, [read_signing_key(tmp_path / "evil.key")]))
    capsys.readouterr()
    out = str(tmp_path / "out.safetensors")
    pull = ["pull", "--board", world.board, "--run", "r1", "--trust", str(world.root), "-o", out]
    assert main([*pull, "--trust-state", str(tmp_path / "state.json")]) == 2
    said = capsys.readouterr().err
    assert "root 2 on the board does not chain from the trusted root 1" in said, said
    assert "remove root/000000000002.json" in said
    assert main(["keygen", "-o", str(tmp_path / "next")]) == 0
    rotate = ["root", "--board", world.board, "--key", str(tmp_path / "next.pub")]
    rotate += ["--sign", str(world.key), "--sign", str(tmp_path / "next.key")]
    capsys.readouterr()
    assert main(rotate) == 2
    assert "remove root/000000000002.json" in capsys.readouterr().err
    os.remove(tmp_path / "board" / root_key(2))  # the operator's fix
    assert main([*pull, "--trust-state", str(tmp_path / "state2.json")]) == 0
    assert main(rotate) == 0


def test_cast_gives_the_view_publish_serves_for_a_tied_checkpoint(tmp_path: Path) -> None:
    """A torch checkpoint whose head is tied to the embedding (one storage, two names):
    `publish` drops the alias (as engines hold it), `cast` kept it, so the same checkpoint
    had two digests (an audit, session 40). Now `cast` names tensors as `publish` does."""
    import torch

    from rollpatch.board import Board

    embed = torch.randn(64, 16)
    state = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,
        "norm.weight": torch.ones(16),
    }
    ckpt = tmp_path / "tied.pt"
    torch.save(state, ckpt)
    board = f"file://{tmp_path / 'board'}"
    assert main(["publish", str(ckpt), "--board", board, "--run", "r1"]) == 0
    out = tmp_path / "cast.safetensors"
    assert main(["cast", str(ckpt), "--format", "bf16", "-o", str(out)]) == 0
    view = load_view(out)
    assert "lm_head.weight" not in view
    assert view.digest() == Board(board).manifest("r1", 0).target


def test_a_short_orphan_grace_is_warned_about(tmp_path: Path, capsys) -> None:
    """`gc --orphan-grace 0` beside a running publisher deletes objects it uploaded but has
    not yet named, and the publisher then stops with "upload objects before the manifest"
    (an audit, session 40): gc now warns below 60 s, and the publisher's hint names gc."""
    board = _published(tmp_path, 1)
    capsys.readouterr()
    assert main(["gc", "--board", board, "--run", "r1", "--orphan-grace", "0"]) == 0
    assert "warning: --orphan-grace 0 s" in capsys.readouterr().err
    assert main(["gc", "--board", board, "--run", "r1", "--orphan-grace", "60"]) == 0
    assert "warning" not in capsys.readouterr().err
