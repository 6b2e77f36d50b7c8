"""A core install (``pip install rollpatch``, no extras: numpy and small codecs) has a working
command line: every subcommand's help, the board commands on a directory board, and a one-line
refusal naming the extra for the services (an audit, session 43: K1, every command died on the
gateway's ``import httpx``, ``--help`` and ``--version`` included). Run in a fresh interpreter
in which every optional extra's modules are absent, as in that install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import masters, save_masters

#: Top-level modules of the optional extras (pyproject.toml) and of the dev tools, absent in a
#: core install.
EXTRAS = (
    "torch",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "pydantic",
    "prometheus_client",
    "uvloop",
    "httptools",
    "matplotlib",
    "transformers",
    "tokenizers",
    "jinja2",
    "accelerate",
    "boto3",
    "botocore",
    "shardcast",
    "xxhash",
    "openai",
)

#: In the fresh interpreter: hide the extras (``sys.modules[m] = None``: ``import m`` fails
#: and ``find_spec`` finds nothing, as when it is not installed), run each command, print
#: what each returned and said as one JSON line.
SCRIPT = """
import contextlib, io, json, sys
for m in sys.argv[1].split(","):
    sys.modules[m] = None
from rollpatch.cli import main
out = []
for argv in json.loads(sys.argv[2]):
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    out.append([argv, rc, std.getvalue()[-300:], err.getvalue()[-600:]])
loaded = sorted(m for m in sys.argv[1].split(",") if sys.modules.get(m) is not None)
print(json.dumps({"runs": out, "loaded": loaded}))
"""


def _commands() -> list[str]:
    """Every subcommand the command line registers (a new one is covered by itself)."""
    import argparse

    from rollpatch.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_a_core_install_runs_the_command_line_and_names_the_missing_extras(
    tmp_path: Path,
) -> None:
    for i in range(2):
        save_masters(tmp_path / f"ck{i}.safetensors", masters(1, step=1e-3 * i))
    board = str(tmp_path / "board")
    runs: list[list[str]] = [["--help"], ["--version"], *([c, "--help"] for c in _commands())]
    runs += [
        ["publish", "--board", board, "--run", "r", str(tmp_path / f"ck{i}.safetensors")]
        for i in range(2)
    ]
    runs += [
        ["status", "--board", board],
        ["pull", "--board", board, "--run", "r", "-o", str(tmp_path / "v.safetensors")],
        ["sidecar", "--board", board, "--run", "r", "--engine", "vllm", "--engine-url", "x"],
        ["relay", "--board", board, "--cache", str(tmp_path / "cache")],
        ["gateway", "--sidecar", "http://127.0.0.1:9"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(EXTRAS), json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["loaded"] == []  # nothing of an extra was imported after all
    results = {" ".join(argv): (rc, out, err) for argv, rc, out, err in said["runs"]}
    for argv in runs:
        rc, _, err = results[" ".join(argv)]
        assert "Traceback" not in err, (argv, err)
        if argv[0] in ("sidecar", "relay", "gateway") and "--help" not in argv:
            assert rc == 2 and "needs the 'web' extra" in err, (argv, rc, err)
            assert "pip install 'rollpatch[web]'" in err
        else:
            assert rc == 0, (argv, rc, err)
    assert results["--version"][1].startswith("rollpatch ")
    assert "r@1" in results[f"pull --board {board} --run r -o {tmp_path / 'v.safetensors'}"][1]


def test_a_native_core_that_does_not_load_is_said_not_silently_replaced() -> None:
    """A core built for another glibc or Python fails to import: one WARNING names why and the
    slower numpy path, and ``--version`` says it (K4: both were silent)."""
    code = (
        "import sys\nsys.modules['rollpatch.native._rpcore'] = None\n"
        "from rollpatch.cli import main\nsys.exit(main(['--version']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "native core NOT LOADED (" in done.stdout and "numpy reference" in done.stdout
    warned = [ln for ln in done.stderr.splitlines() if "native codec core did not load" in ln]
    assert len(warned) == 1 and "C compiler" in warned[0], done.stderr
    ok = _version()
    assert ok.stdout.startswith("rollpatch ") and "native core " in ok.stdout
    assert "NOT LOADED" not in ok.stdout and not ok.stderr


def _version(**env: str) -> subprocess.CompletedProcess[str]:
    """``rollpatch --version`` in a fresh interpreter, with ``env`` added to the environment."""
    import os

    return subprocess.run(
        [sys.executable, "-m", "rollpatch", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
    )


def test_an_unknown_isa_level_is_said_not_ignored_silently() -> None:
    done = _version(ROLLPATCH_ISA="avx-512")  # a typo of avx512
    assert done.returncode == 0 and "native core " in done.stdout
    assert "ROLLPATCH_ISA=avx-512 is not one of scalar, avx2, avx512: ignored" in done.stderr
