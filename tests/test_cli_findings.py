"""What the command line says (an audit, session 41): ``diff --scales frozen`` of checkpoints
refused (H-F5), a quantised format that quantises nothing warned of (H-F6), int buffers named
as such (H-F7), a pull around a corrupt object said without ``-v`` (H-F8), the applied view's
format label (H-F9), digest algorithms named (H-F10), safetensors holes refused (H-F11),
``status --trust`` after a planned rotation (H-F13), and log events with their fields
(G-F7). Real files, real CLI invocations."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.cli import EXIT_REFUSED, main
from rollpatch.formats import cast_view
from rollpatch.io import load_view, save_view
from rollpatch.patch import diff, encode
from tests.conftest import masters, save_masters, signing_world

GOLDEN = Path(__file__).parent / "golden" / "v1"


def _run(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 0) -> tuple[str, str]:
    assert main(argv) == code
    out, err = capsys.readouterr()
    return out, err


def test_diff_of_checkpoints_refuses_frozen_scales(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = ckpts
    out = tmp_path / "p.rpatch"
    argv = ["diff", str(old), str(new), "--format", "nvfp4", "--scales", "frozen"]
    _, err = _run(capsys, [*argv, "-o", str(out)], EXIT_REFUSED)
    assert "--scales frozen" in err and "--previous" in err and "diff --views" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    # the way it points to: the run's views, cast in order, then diffed
    v0, v1 = tmp_path / "v0.safetensors", tmp_path / "v1.safetensors"
    _run(capsys, ["cast", str(old), "--format", "nvfp4", "--scales", "frozen", "-o", str(v0)])
    frozen = ["--format", "nvfp4", "--scales", "frozen", "--previous", str(v0)]
    _run(capsys, ["cast", str(new), *frozen, "-o", str(v1)])
    _run(capsys, ["diff", "--views", str(v0), str(v1), "-o", str(out)])
    applied = tmp_path / "a.safetensors"
    _run(capsys, ["apply", str(v0), str(out), "-o", str(applied)])
    assert load_view(applied).digest() == load_view(v1).digest()
    with pytest.raises(SystemExit):
        main(["diff", "--help"])
    assert "diff --views" in capsys.readouterr().out


def test_a_quantised_format_that_quantises_nothing_is_warned_of(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = ckpts
    out, err = _run(capsys, ["cast", str(old), "--format", "nvfp4", "-o", str(tmp_path / "a")])
    assert "1 of 3 tensors quantised" in out and not err
    typo = ["--include", "model.layers.*.mlp.up_projj.weight"]
    argv = ["cast", str(old), "--format", "nvfp4", *typo, "-o", str(tmp_path / "b")]
    out, err = _run(capsys, argv)
    assert "0 of 3 tensors quantised" in out
    assert err.startswith("rollpatch: warning: nvfp4 quantises none of the 3 tensors")
    out, err = _run(
        capsys,
        ["diff", str(old), str(new), "--format", "int4-g128", *typo, "-o", str(tmp_path / "p")],
    )
    assert "0 of 3 tensors quantised" in out and "quantises none" in err
    board = str(tmp_path / "board")
    out, err = _run(
        capsys, ["publish", "--board", board, "--run", "q", "--format", "mxfp4", *typo, str(old)]
    )
    assert "0 of 3 tensors quantised" in out and "quantises none" in err
    # analyze: the count in its report and JSON, the same warning (N-4, session 41: none)
    argv = ["analyze", str(old), str(new), "--format", "nvfp4", "--no-progress"]
    out, err = _run(capsys, [*argv, *typo])
    assert "nvfp4: 0 of 3 tensors quantised" in out and "quantises none" in err
    out, err = _run(capsys, [*argv, "--format", "bf16", "--json"])
    assert json.loads(out)["model"]["quantised"] == {"nvfp4": 1} and not err
    out, err = _run(capsys, ["cast", str(old), "-o", str(tmp_path / "c")])  # bf16: no count
    assert "tensors quantised" not in out and not err


def test_int_buffers_are_named_as_buffers_not_float64(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = masters(1)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    from rollpatch.view import Tensor, View

    for path, step in ((a, 0.0), (b, 1e-3)):
        ms = masters(2, step=step) if step else m
        tensors = {k: Tensor.from_array(v) for k, v in ms.items()}
        tensors["pos_ids"] = Tensor.from_array(np.arange(10, dtype=np.int64))
        save_view(View(tensors), path)
    _, err = _run(capsys, ["cast", str(a), "-o", str(tmp_path / "v")], EXIT_REFUSED)
    assert "'pos_ids' is int64" in err and "buffers, not served weights" in err
    assert "float64" not in err
    board = str(tmp_path / "board")
    _, err = _run(capsys, ["publish", "--board", board, "--run", "r", str(a)], EXIT_REFUSED)
    assert "'pos_ids' is int64" in err
    out, _ = _run(capsys, ["analyze", str(a), str(b), "--no-progress"])
    assert "left out (not served): pos_ids" in out
    assert "cast, diff and publish refuse a checkpoint holding them" in out


def test_pull_says_when_it_plans_around_a_corrupt_object(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    board = tmp_path / "board"
    for i in range(4):
        ck = tmp_path / f"ck{i}.safetensors"
        save_masters(ck, masters(1, step=1e-3 * i))
        pub = ["publish", "--board", str(board), "--run", "r", "--keyframe-every", "2", str(ck)]
        _run(capsys, pub)
    b = Board(f"file://{board}")
    key = b.manifest("r", 2).keyframes[0].ref.key
    path = board / key
    path.write_bytes(path.read_bytes()[:1000])
    out, err = _run(
        capsys, ["pull", "--board", str(board), "--run", "r", "-o", str(tmp_path / "v")]
    )
    said = [ln for ln in err.splitlines() if "corrupt" in ln]
    assert len(said) == 1 and said[0].startswith("rollpatch: WARNING ") and key in said[0]
    assert "re-planned around 1 corrupt object" in out
    assert load_view(tmp_path / "v").digest() == b.manifest("r", 3).target


def test_apply_writes_the_format_the_result_has(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = ckpts
    a, n = tmp_path / "a.safetensors", tmp_path / "n.safetensors"
    _run(capsys, ["cast", str(old), "-o", str(a)])
    _run(capsys, ["cast", str(new), "--format", "nvfp4", "-o", str(n)])
    p, out = tmp_path / "x.rpatch", tmp_path / "out.safetensors"
    _run(capsys, ["diff", "--views", str(a), str(n), "-o", str(p)])
    _run(capsys, ["apply", str(a), str(p), "-o", str(out)])
    got = load_view(out)
    assert got.digest() == load_view(n).digest()
    assert got.metadata["rollpatch.format"] == "nvfp4"
    # a patch that names no format (encoded by the API) and retypes tensors: no label
    va, vn = load_view(a), load_view(n)
    p.write_bytes(encode(diff(va, vn), va))
    text, _ = _run(capsys, ["apply", str(a), str(p), "-o", str(out)])
    assert "rollpatch.format" not in load_view(out).metadata and "label left out" in text
    # a step of one format keeps it
    b1 = tmp_path / "b1.safetensors"
    _run(capsys, ["cast", str(new), "-o", str(b1)])
    _run(capsys, ["diff", "--views", str(a), str(b1), "-o", str(p)])
    _run(capsys, ["apply", str(a), str(p), "-o", str(out)])
    assert load_view(out).metadata["rollpatch.format"] == "bf16"


def test_apply_and_inspect_name_the_digest_algorithm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patch = GOLDEN / "step.rpatch"
    out, _ = _run(capsys, ["inspect", str(patch)])
    target = next(ln for ln in out.splitlines() if ln.startswith("target"))
    assert target.split()[1] == "rp.blake3.v1" and "patch format 1" in out
    digest = target.split()[2]
    out, _ = _run(
        capsys, ["apply", str(GOLDEN / "base.safetensors"), str(patch), "-o", str(tmp_path / "v")]
    )
    assert f"digest rp.blake3.v1 {digest[:16]}" in out
    info = json.loads(_run(capsys, ["inspect", str(patch), "--json"])[0])
    assert info["digest"] == "rp.blake3.v1" and info["target"] == digest


def test_safetensors_with_holes_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    h = json.dumps({"a.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [16, 80]}})
    raw = h.encode()
    path = tmp_path / "gap.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\xff" * 96)
    _, err = _run(capsys, ["cast", str(path), "-o", str(tmp_path / "o")], EXIT_REFUSED)
    assert "hole" in err and "gap.safetensors" in err and not (tmp_path / "o").exists()


def test_status_after_a_planned_rotation_lists_retired_versions_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world = signing_world(tmp_path, "old")
    _run(capsys, ["keygen", "-o", str(tmp_path / "new")])
    old, new = ["--signing-key", str(world.key)], ["--signing-key", str(tmp_path / "new.key")]
    publish = ["publish", "--board", world.board, "--run", "r"]
    cks = []
    for i in range(4):
        cks.append(tmp_path / f"ck{i}.safetensors")
        save_masters(cks[i], masters(1, step=1e-4 * i))
    for i in range(2):
        _run(capsys, [*publish, str(cks[i]), *old])
    _run(capsys, [*publish, str(cks[2]), *old, *new, "--keyframe"])  # docs/trust.md step 1
    rotate = ["root", "--board", world.board, "--key", str(tmp_path / "new.pub")]
    _run(capsys, [*rotate, "--sign", str(world.key), "--sign", str(tmp_path / "new.key")])
    _run(capsys, [*publish, str(cks[3]), *new])
    trusted = ["--trust", str(world.root), "--trust-state", str(tmp_path / "st.json")]
    out, err = _run(capsys, ["status", "--board", world.board, *trusted])
    assert "2 signed by retired keys" in out and "refused" not in out + err
    rows = [ln.split() for ln in out.splitlines() if "retired:" in ln]
    assert [r[0] for r in rows] == ["0", "1"]
    doc = json.loads(_run(capsys, ["status", "--board", world.board, *trusted, "--json"])[0])
    run = doc["runs"][0]
    assert run["n_refused"] == 0 and run["n_retired"] == 2
    # through a relay that trusts the same root, which refuses those manifests to everyone,
    # its refusal says the root they were signed under (audit I M2: exit 2, "refused")
    from rollpatch.relay import RelayConfig, RelayServer
    from rollpatch.trust import Trust

    relay_trust = Trust.from_file(world.root, state_path=tmp_path / "relay-st.json")
    config = RelayConfig(cache_dir=str(tmp_path / "cache"))
    relay = RelayServer(world.board, config, trust=relay_trust)
    url = relay.start()
    try:
        via = ["status", "--board", url, *trusted]
        out, err = _run(capsys, via)
        assert "2 signed by retired keys" in out and "refused" not in out, out
        assert "rollpatch: error" not in err and "WARNING refused" not in err, err
        rows = [ln for ln in out.splitlines() if "retired:" in ln]
        assert len(rows) == 2 and all("as the relay checked it" in r for r in rows), rows
        run = json.loads(_run(capsys, [*via, "--json"])[0])["runs"][0]
        assert run["n_refused"] == 0 and run["n_retired"] == 2
        assert {v.get("retired_checked_by") for v in run["versions"][:2]} == {"relay"}
    finally:
        relay.stop()
    # a forged manifest is still a refusal
    b = Board(world.board)
    raw = b.store.get("runs/r/versions/000000000001.json")
    forged = json.loads(raw)
    forged["signatures"][0]["sig"] = forged["signatures"][1 % len(forged["signatures"])]["sig"][
        ::-1
    ]
    b.store.put("runs/r/versions/000000000001.json", json.dumps(forged).encode(), if_absent=False)
    _, err = _run(capsys, ["status", "--board", world.board, *trusted], EXIT_REFUSED)
    assert "1 manifest refused" in err


def test_log_events_of_one_shot_commands_show_their_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A relay that is down: the retry event is said with its fields, not as a bare name."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    _, err = _run(capsys, ["status", "--board", f"http://127.0.0.1:{port}"], EXIT_REFUSED)
    lines = err.strip().splitlines()
    retry = [ln for ln in lines if "relay_retry" in ln]
    assert retry and retry[0].startswith("rollpatch: WARNING relay_retry store=http://")
    assert "attempt=1" in retry[0] and "error=" in retry[0]
    assert lines[-1].startswith("rollpatch: error: relay request failed")


def test_cast_view_api_matches_the_cli_after_the_refactor(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    old, _ = ckpts
    _run(capsys, ["cast", str(old), "--format", "fp8-e4m3-block128", "-o", str(tmp_path / "v")])
    want = cast_view(masters(1), "fp8-e4m3-block128").digest()
    assert load_view(tmp_path / "v").digest() == want


@pytest.fixture
def busy_relay() -> Iterator[tuple[str, list[str]]]:
    """A stand-in relay that answers every GET 503; yields its URL and the paths asked."""
    import http.server
    import threading

    hits: list[str] = []

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()


def test_pull_retries_bound_every_attempt_through_a_relay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], busy_relay: tuple[str, list[str]]
) -> None:
    """``pull --retries N`` is N + 1 attempts per read through a relay: the relay client's own
    retries are off for it (N-6, session 41: each of the follower's attempts was 4 requests)."""
    board, hits = busy_relay
    for retries in (0, 2):
        hits.clear()
        argv = ["pull", "--board", board, "--run", "r", "-o", str(tmp_path / "v")]
        _, err = _run(capsys, [*argv, "--retries", str(retries), "--backoff", "0.01"], EXIT_REFUSED)
        assert len(hits) == retries + 1 and len(set(hits)) == 1, hits
        said = err.strip().splitlines()[-1]
        assert said.startswith("rollpatch: error: ") and f"attempts={retries + 1}" in said


@pytest.mark.parametrize("opened_by", ["follower", "sidecar", "sidecar-cli"])
def test_a_follower_that_opens_its_relay_owns_the_retries(
    busy_relay: tuple[str, list[str]], opened_by: str
) -> None:
    """A follower or sidecar given a relay's URL (or the ``sidecar`` command's board) makes
    ``retries + 1`` requests per read: the relay client's own 3 retries are off, so an outage
    is not (retries + 1) x 4 requests and two nested backoffs (session 42's list)."""
    from rollpatch.cli.serving import upstream_store
    from rollpatch.engines import ViewEngine
    from rollpatch.errors import RollpatchError
    from rollpatch.follower import Follower, FollowerConfig
    from rollpatch.sidecar import Sidecar, SidecarConfig

    url, hits = busy_relay
    config = FollowerConfig(retries=2, backoff_s=0.01)
    if opened_by == "follower":
        follower = Follower(url, "r", ViewEngine(), config)
    else:
        board = (
            url if opened_by == "sidecar" else Board(upstream_store(url, None, retried_by="reader"))
        )
        sidecar = Sidecar(
            board, "r", ViewEngine(), "http://127.0.0.1:9", SidecarConfig(follower=config)
        )
        follower = sidecar.follower
    with pytest.raises(RollpatchError, match="attempts=3"):
        follower.sync()
    assert len(hits) == 3 and len(set(hits)) == 1, hits


def test_publish_says_when_it_created_the_board_directory(
    tmp_path: Path, ckpts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped ``--board`` or an absent mount made a new board at version 0 and said
    nothing about it (session 41's list): the note says the directory was created."""
    old, new = ckpts
    board = str(tmp_path / "mnt" / "board")
    argv = ["publish", "--board", board, "--run", "r"]
    _, err = _run(capsys, [*argv, str(old)])
    assert err.startswith("rollpatch: note: the board directory file://") and "version 0" in err
    out, err = _run(capsys, [*argv, str(new), "--json"])
    assert "did not exist" not in err and json.loads(out)["board_created"] is False
