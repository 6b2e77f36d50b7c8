"""Cheap mistakes fail fast and clearly (one line, exit 2, before anything heavy loads), and
the services' structured logs (``rollpatch.logs``: text or JSON, ``--log-level``)."""

from __future__ import annotations

import io
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.cli import EXIT_REFUSED, main, preflight
from rollpatch.logs import configure, event
from rollpatch.publisher import Publisher, PublisherConfig
from rollpatch.store import open_store


def _rollpatch(*args: str, pre: str = "") -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter; ``pre`` runs first, then ``post`` after main."""
    code = (
        f"import sys\n{pre}\nfrom rollpatch.cli import main\nrc = main(sys.argv[1:])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'fastapi', 'uvicorn') "
        "if m in sys.modules)\nprint('HEAVY', heavy, file=sys.stderr)\nsys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the CLI in this process; it must refuse with one line and exit 2."""
    assert main(list(args)) == EXIT_REFUSED
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollpatch: error: "), err
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def board_dir(tmp_path: Path) -> Path:
    d = tmp_path / "board"
    d.mkdir()
    return d


def test_status_of_a_typo_board_creates_nothing_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "bord"
    assert f"no board at {typo}" in _refused(capsys, "status", "--board", str(typo))
    assert "no board at" in _refused(capsys, "status", "--board", typo.as_uri())
    for cmd in (
        ("pull", "--board", str(typo), "--run", "r", "-o", str(tmp_path / "v")),
        ("gc", "--board", str(typo), "--run", "r", "--keep-last", "2"),
        ("relay", "--board", typo.as_uri(), "--cache", str(tmp_path / "c"), "--port", "0"),
    ):
        assert "no board at" in _refused(capsys, *cmd)
    assert not typo.exists()


def test_a_memory_board_is_refused_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A memory:// board lives in the command's process: a publish there was lost when it
    exited (exit 0), and a reader found nothing."""
    ckpt = tmp_path / "a.safetensors"
    ckpt.write_bytes(b"not read: the board is refused first")
    for cmd in (
        ("publish", "--board", "memory://x", "--run", "r", str(ckpt)),
        ("status", "--board", "memory://x"),
        ("pull", "--board", "memory://x", "--run", "r", "-o", str(tmp_path / "v")),
        ("relay", "--board", "memory://x", "--cache", str(tmp_path / "c"), "--port", "0"),
    ):
        assert "memory:// board lives in this process only" in _refused(capsys, *cmd)


def test_a_file_uri_with_two_slashes_is_refused_not_read_as_another_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``file://tmp/board`` put 'tmp' in the host part: the command looked in /board."""
    said = _refused(capsys, "status", "--board", "file://tmp/p36/board")
    assert "needs three slashes" in said and "file:///tmp/p36/board (absolute)" in said
    assert "the plain path tmp/p36/board (relative" in said  # what a relative path meant


def test_files_are_named_in_every_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing, misplaced or corrupt file is refused in one line that names it (and which
    option), before any work: not errno text about a temporary file, nor a header error that
    does not say which of two inputs was corrupt."""
    import numpy as np
    from safetensors.numpy import save_file

    good = tmp_path / "a.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, str(good))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(range(256)) * 4)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x80\x05junk" * 10)
    out = str(tmp_path / "o.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        f"checkpoint folder {empty} holds no weights": ("cast", str(empty), "-o", out),
        f"checkpoint not found: {tmp_path / 'nope.pt'}": (
            "cast",
            str(tmp_path / "nope.pt"),
            "-o",
            out,
        ),
        f"{bad}: safetensors header": ("diff", str(good), str(bad), "-o", out),
        f"cannot read torch checkpoint {junk}: not a torch.save file of tensors": (
            "cast",
            str(junk),
            "-o",
            out,
        ),
        f"-o: the directory {tmp_path / 'no' / 'dir'} does not exist": (
            "cast",
            str(good),
            "-o",
            str(tmp_path / "no" / "dir" / "x"),
        ),
        f"-o: {tmp_path} is a directory": ("cast", str(good), "-o", str(tmp_path)),
        f"patch not found: {tmp_path / 'nope.rpatch'}": ("inspect", str(tmp_path / "nope.rpatch")),
        f"--cache: {good} is not a directory": (
            "relay",
            "--board",
            str(tmp_path),
            "--cache",
            str(good),
            "--port",
            "0",
        ),
    }
    for said, cmd in cases.items():
        assert said in _refused(capsys, *cmd), cmd
    assert not (tmp_path / "no").exists()


def test_unknown_board_scheme_is_named(board_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in (
        ("status", "--board", "fle:///data/board"),
        ("sidecar", "--board", "ftp://host/b", "--run", "r", "--model", "m"),
        ("relay", "--board", "sftp://x", "--cache", str(board_dir / "c")),
    ):
        assert "unknown board scheme" in _refused(capsys, *cmd)
    assert "needs a bucket" in _refused(capsys, "status", "--board", "s3:///x")


def test_port_in_use_is_named_before_anything_heavy_loads(
    board_dir: Path, busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()  # not a loadable model: the port must be refused before any load
    # a fresh interpreter: the refusal comes before torch, transformers or the web stack
    r = _rollpatch(
        "sidecar",
        "--board",
        str(board_dir),
        "--run",
        "r",
        "--model",
        str(model),
        "--port",
        str(busy_port),
    )
    assert r.returncode == EXIT_REFUSED
    assert f"port {busy_port} on 127.0.0.1 is already in use" in r.stderr
    assert "HEAVY []" in r.stderr and "Traceback" not in r.stderr
    for cmd in (
        (
            "relay",
            "--board",
            str(board_dir),
            "--cache",
            str(tmp_path / "c"),
            "--port",
            str(busy_port),
        ),
        ("gateway", "--sidecar", "http://127.0.0.1:9", "--port", str(busy_port)),
    ):
        assert f"port {busy_port}" in _refused(capsys, *cmd)


def test_model_must_be_a_local_directory(
    board_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a hub-style name that is not a local directory: refused, the hub is never asked
    hub = "Qwen/Qwen3-0.6B"
    line = _refused(
        capsys, "sidecar", "--board", str(board_dir), "--run", "r", "--model", hub, "--port", "0"
    )
    assert f"no model directory at {hub}" in line and "never downloads" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _refused(
        capsys,
        "sidecar",
        "--board",
        str(board_dir),
        "--run",
        "r",
        "--model",
        str(empty),
        "--port",
        "0",
    )
    assert "has no config.json" in line


def test_adopt_scan_without_boot_adopt_is_refused_not_ignored(
    board_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ("sidecar", "--board", str(board_dir), "--run", "r", "--port", "0")
    line = _refused(capsys, *base, "--adopt-scan", "8")
    assert "--adopt-scan only applies with --boot adopt" in line
    line = _refused(capsys, *base, "--boot", "keyframe", "--adopt-scan", "8")
    assert "--boot adopt" in line
    # with --boot adopt the flag passes this check (the next one is the missing --model)
    line = _refused(capsys, *base, "--boot", "adopt", "--adopt-scan", "8")
    assert "--model is required" in line


@pytest.mark.parametrize(
    ("hidden", "cmd", "extra"),
    [
        ("fastapi", ("sidecar", "--run", "r", "--model", "m"), "reference"),
        ("torch", ("sidecar", "--run", "r", "--model", "m"), "reference"),
        ("uvicorn", ("relay", "--cache", "c"), "web"),
        ("fastapi", ("gateway", "--sidecar", "http://127.0.0.1:9", "--port", "0"), "web"),
        ("boto3", ("status", "--board", "s3://bucket/prefix"), "s3"),
        ("transformers", ("demo", "--steps", "1", "--out", "unused"), "reference"),
    ],
)
def test_missing_extra_is_one_line_naming_it(
    board_dir: Path,
    hidden: str,
    cmd: tuple[str, ...],
    extra: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if "--board" not in cmd and cmd[0] not in ("gateway", "demo"):
        cmd = (*cmd, "--board", str(board_dir))
    # what "not installed" means to the check: the import system cannot find the module
    monkeypatch.setattr(preflight, "_importable", lambda m: m != hidden)
    line = _refused(capsys, *cmd)
    assert f"needs the '{extra}' extra" in line
    assert f"pip install 'rollpatch[{extra}]'" in line


def test_missing_extra_in_a_fresh_interpreter(board_dir: Path) -> None:
    r = _rollpatch(
        "sidecar",
        "--board",
        str(board_dir),
        "--run",
        "r",
        "--model",
        "m",
        pre="sys.modules['fastapi'] = None",
    )
    assert r.returncode == EXIT_REFUSED and "Traceback" not in r.stderr
    assert "pip install 'rollpatch[reference]'" in r.stderr


def test_netem_is_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["netem", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--latency-ms" in out and "--mbps" in out
    assert "--upstream must be HOST:PORT" in _refused(capsys, "netem", "--upstream", "nowhere")


def test_an_unknown_flag_is_named_by_its_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """``rollpatch cast x --bogus`` points to ``rollpatch cast --help``, not the top level."""
    with pytest.raises(SystemExit) as e:
        main(["cast", "x.safetensors", "--bogus", "-o", "y"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == EXIT_REFUSED
    assert err == (
        "rollpatch cast: error: unrecognized arguments: --bogus (see rollpatch cast --help)"
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["pull", "--board", "b", "--run", "r", "-o", "o", "--version", "-1"], "--version: must"),
        (["pull", "--board", "b", "--run", "r", "-o", "o", "--version", "9" * 23], "0 to"),
        (["gc", "--board", "b", "--run", "r", "--keep-last", "-3"], "--keep-last: must"),
        (["gc", "--board", "b", "--run", "r", "--pin", "-2"], "--pin: must"),
        (["publish", "--board", "b", "--run", "r", "x", "--step", "-5"], "--step: must"),
        (["pull", "--board", "b", "--run", "r", "-o", "o", "--workers", "0"], "--workers: must"),
    ],
)
def test_bad_numbers_are_refused_by_their_flag(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A number out of its flag's range is refused while parsing, naming the flag (not an
    internal field such as ``FollowerConfig.fetch_workers`` or ``want``)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == EXIT_REFUSED and len(err.splitlines()) == 1
    assert f"rollpatch {argv[0]}: error: argument " in err and said in err, err


def test_gc_says_what_a_pin_and_the_cutoff_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pin of a version the run does not have pins nothing (said so on stderr); a cutoff
    held back to the keyframe the kept versions need says so."""
    import numpy as np
    from safetensors.numpy import save_file

    ckpt, board = tmp_path / "a.safetensors", str(tmp_path / "board")
    (tmp_path / "board").mkdir()
    for i in range(4):
        save_file({"w": np.full((4, 4), i, np.float32)}, str(ckpt))
        assert main(["publish", "--board", board, "--run", "r", str(ckpt)]) == 0
    capsys.readouterr()
    argv = ["gc", "--board", board, "--run", "r", "--keep-last", "1", "--pin", "99", "--dry-run"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "--pin 99: no such version; it pins nothing" in err
    assert "keeping versions >= 0 (v0: the keyframe the kept versions are rebuilt from)" in out
    # a run the board does not have (a typo) is refused, naming the runs it has
    assert main(["gc", "--board", board, "--run", "nope", "--dry-run"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "run 'nope' has nothing on the board" in err and "runs on it: r" in err


# -- structured logs (tests/conftest.py puts the rollpatch logger back after each test) ---------


def test_events_as_json_lines_and_text() -> None:
    out = io.StringIO()
    configure("info", "json", stream=out)
    log = logging.getLogger("rollpatch.sidecar")
    event(log, "commit", run="grpo", version=41, pause_s=0.003)
    event(log, "detail", logging.DEBUG, x=1)  # below the level: not written
    log.warning("plain %s", "text")
    try:
        raise ValueError("bad bits")
    except ValueError:
        log.exception("sync failed")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["event"] for x in lines] == ["commit", "log", "log"]
    assert lines[0] | {"ts": None} == {
        "ts": None,
        "level": "info",
        "logger": "rollpatch.sidecar",
        "event": "commit",
        "run": "grpo",
        "version": 41,
        "pause_s": 0.003,
    }
    assert lines[1]["message"] == "plain text" and lines[1]["level"] == "warning"
    assert lines[2]["error"] == "ValueError: bad bits" and "traceback" not in lines[2]

    out = io.StringIO()
    configure("debug", "text", stream=out)  # replaces the JSON handler
    event(log, "refused", status=409, reason="older than served")
    text = out.getvalue()
    assert text.count("\n") == 1
    assert ' INFO rollpatch.sidecar refused status=409 reason="older than served"' in text
    configure("warning", "text", stream=io.StringIO())
    with pytest.raises(ValueError, match="log format"):
        configure("info", "xml")  # type: ignore[arg-type]


def test_relay_logs_fetches_as_json(tmp_path: Path) -> None:
    """A real relay process with ``--log-format json``: each upstream fetch is one event, and
    every line is JSON, the HTTP server's own (start, a malformed request: once) included."""
    board_uri = (tmp_path / "board").as_uri()
    rng = np.random.default_rng(0)
    masters = {"w": rng.standard_normal((64, 64)).astype(np.float32)}
    with Publisher(board_uri, "r", PublisherConfig(format="bf16")) as pub:
        pub.publish(masters)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollpatch",
            "relay",
            "--board",
            board_uri,
            "--cache",
            str(tmp_path / "cache"),
            "--port",
            "0",
            "--log-level",
            "info",
            "--log-format",
            "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.split(" at ", 1)[1].split()[0]
        board = Board(open_store(url))
        ref = board.manifest("r", 0).keyframes[0].ref
        assert len(board.fetch(ref)) == ref.size
        host, port = url.removeprefix("http://").split(":")
        for _ in range(5):  # a scanner's garbage: the server's warning, paced, in JSON too
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"NONSENSE\x00\r\n\r\n")
                s.recv(1024)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = err.splitlines()  # every line JSON: the HTTP server's own ones too (L5)
    events = [json.loads(x) for x in lines]
    invalid = [e for e in events if "Invalid HTTP request" in e.get("message", "")]
    assert len(invalid) == 1 and invalid[0]["level"] == "warning", lines
    assert any("Started server process" in e.get("message", "") for e in events)
    assert {(e["service"], e["pid"]) for e in events} == {("relay", proc.pid)}  # L15
    fetched = [e for e in events if e["event"] == "fetched" and e["key"] == ref.key]
    assert len(fetched) == 1 and fetched[0]["bytes"] == ref.size
    assert fetched[0]["logger"] == "rollpatch.relay" and fetched[0]["kind"] == "object"


def test_a_relay_cache_it_cannot_write_is_refused_at_start(
    board_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only or full cache used to start, say /health ok, and answer 503 to every
    uncached read (an audit's MEDIUM finding). Root writes through a 0555 mode, so the
    unwritable directory here is one below a regular file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    base = ("relay", "--board", str(board_dir), "--port", "0")
    line = _refused(capsys, *base, "--cache", str(blocker / "cache"))
    assert "--cache: cannot write to" in line and "writable directory" in line
