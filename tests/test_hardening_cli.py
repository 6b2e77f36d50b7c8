"""Issue 11: the CLI exits 2 with one line (never a traceback) on any bad input to the
services' commands, including the TLS, token and timeout options."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpatch.cli import main


def _one_line_refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code  # type: ignore[assignment]
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    # a service may first say, in one warning line, that it runs without a trust root
    lines = [ln for ln in out.err.strip().splitlines() if "warning" not in ln.lower()]
    assert code == 2, (argv, code, out.err)
    assert len(lines) == 1 and ": error: " in lines[0], (argv, out.err)
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "board").mkdir()  # readers refuse a board that does not exist
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "junk.pem").write_text("not a certificate")
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "binary").write_bytes(b"\x00\xff\x1b[2J")
    return {k: str(tmp_path / k) for k in ("empty", "junk.pem", "token", "binary")} | {
        "missing": str(tmp_path / "missing.pem"),
        "cache": str(tmp_path / "cache"),
        "board": f"file://{tmp_path / 'board'}",
    }


def test_bad_service_options_exit_2_with_one_line(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    relay = ["relay", "--board", files["board"], "--cache", files["cache"], "--port", "0"]
    gateway = ["gateway", "--sidecar", "a=http://127.0.0.1:9", "--port", "0"]
    sidecar = [
        "sidecar",
        "--board",
        files["board"],
        "--run",
        "r1",
        "--port",
        "0",
        "--engine",
        "vllm",
        "--engine-url",
        "http://127.0.0.1:9",
    ]
    cases = [
        (relay + ["--tls-cert", files["missing"], "--tls-key", files["missing"]], "no such"),
        (relay + ["--tls-cert", files["junk.pem"], "--tls-key", files["junk.pem"]], "TLS"),
        (relay + ["--tls-cert", files["junk.pem"]], "together"),
        (relay + ["--token-file", files["empty"]], "empty"),
        (relay + ["--token-file", files["binary"]], "printable"),
        (relay + ["--board-token-file", files["token"]], "relay"),
        (relay + ["--header-timeout", "-1"], "header-timeout"),
        (relay + ["--header-timeout", "nan"], "header-timeout"),
        (gateway + ["--body-timeout", "0"], "body-timeout"),
        (gateway + ["--token-file", files["missing"]], "cannot read"),
        (gateway + ["--island-token-file", files["empty"]], "empty"),
        (["gateway", "--sidecar", "ftp://nowhere", "--port", "0"], "http(s)"),
        (gateway + ["--max-body-bytes", "0"], "max_bytes"),
        (sidecar + ["--tls-cert", files["junk.pem"], "--tls-key", files["junk.pem"]], "TLS"),
        (sidecar + ["--token-file", files["empty"]], "empty"),
        (sidecar + ["--port", "http"], "port"),
        (["sidecar"], "required"),
        (["no-such-command"], "invalid choice"),
    ]
    for argv, expected in cases:
        line = _one_line_refusal(argv, capsys)
        assert expected in line, (argv, line)
