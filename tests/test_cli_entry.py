"""The ``rollpatch`` entry point: stdout closed early (``| head``) and ``demo --codec-only``
on small models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollpatch.cli import EXIT_REFUSED, EXIT_SIGPIPE, main
from rollpatch.cli.demo import _codec_vocab
from rollpatch.formats import cast_view
from rollpatch.io import save_view
from rollpatch.sim import llama_dims


@pytest.fixture(scope="module")
def big_json_patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A patch over 3,000 tensors: ``inspect --json`` prints over 1 MB, far more than a pipe
    buffers, so a reader that leaves early breaks the pipe."""
    root = tmp_path_factory.mktemp("pipe")
    rng = np.random.default_rng(0)
    a = {f"t{i}": rng.standard_normal(8).astype(np.float32) for i in range(3000)}
    b = {k: v + np.float32(0.01) for k, v in a.items()}
    save_view(cast_view(a, "bf16"), root / "a.safetensors")
    save_view(cast_view(b, "bf16"), root / "b.safetensors")
    patch = root / "p.rpatch"
    assert (
        main(
            [
                "diff",
                str(root / "a.safetensors"),
                str(root / "b.safetensors"),
                "--views",
                "-o",
                str(patch),
            ]
        )
        == 0
    )
    return patch


def _rollpatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollpatch", *args]


def test_json_piped_into_head_ends_quietly(big_json_patch: Path) -> None:
    producer = subprocess.Popen(
        _rollpatch("inspect", str(big_json_patch), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert producer.stdout is not None and producer.stderr is not None
    head = subprocess.run(
        ["head", "-c", "10"], stdin=producer.stdout, capture_output=True, timeout=120, check=True
    )
    producer.stdout.close()
    err = producer.stderr.read().decode()
    producer.stderr.close()
    code = producer.wait(timeout=120)
    assert head.stdout.startswith(b'{\n "') and len(head.stdout) == 10
    assert err == ""  # no traceback, no "Broken pipe" line
    assert code in (0, EXIT_SIGPIPE)  # 0 only if it finished writing before head left


def test_stdout_without_reader_exits_141_silently(big_json_patch: Path) -> None:
    proc = subprocess.Popen(
        _rollpatch("inspect", str(big_json_patch), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the first write
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err.decode()) == (EXIT_SIGPIPE, "")


def test_help_piped_into_head_ends_quietly() -> None:
    proc = subprocess.Popen(_rollpatch("--help"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert err.decode() == "" and proc.returncode in (0, EXIT_SIGPIPE)


@pytest.mark.parametrize("n_params", [100_000, 2_000_000, 8_000_000, 20_000_000])
def test_codec_vocab_fits_every_allowed_size(n_params: int) -> None:
    v = _codec_vocab(n_params)
    dims = llama_dims(n_params, v)  # raised ValueError for < 4.2M with vocab 32000
    assert dims.layers >= 1 and 2 * v * dims.hidden < n_params
    assert _codec_vocab(20_000_000) == 32000  # the default --params keeps Llama's vocab


def test_demo_codec_only_runs_a_2m_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "demo",
                "--codec-only",
                "--params",
                "2000000",
                "--steps",
                "1",
                "--formats",
                "bf16",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "all 1 transitions verified bit-exact" in out
    assert (tmp_path / "bf16.v0-v1.rpatch").exists()


def test_demo_codec_only_refuses_a_too_small_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--codec-only", "--params", "5e4"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.startswith("rollpatch: error: --params") and "100,000" in err
