"""scripts/pyinstall: pip's configuration carried over to uv, and the choice of installer.

uv reads none of pip's configuration; the venv builds rely on it (the CPU torch wheel in a
find-links folder, local indexes, a constraint file), so ``pyinstall uv-args`` turns
``pip config list`` into uv's options. These run pip's own config reader on a config file and
PIP_* variables made here (the machine's own files hidden where pip allows it), with no network.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYINSTALL = REPO / "scripts" / "pyinstall"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """An environment without the caller's PIP_*/UV_* settings or user/XDG pip config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_CONFIG_DIRS=str(tmp_path / "no-xdg"),
        PYTHON=sys.executable,
        ROLLPATCH_CACHE=str(tmp_path / "cache"),
    )
    env.update(extra)
    return env


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = ["bash", str(PYINSTALL), *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def _pairs(out: str) -> list[tuple[str, str]]:
    """uv's options as (flag, value) pairs; a flag without a value pairs with ''."""
    words = [w for w in out.split("\n") if w]
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
        pairs.append((words[i], value))
        i += 2 if value else 1
    return pairs


def test_pip_config_becomes_uv_options_in_pips_precedence(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\n"
        "index-url = https://global.example/simple\n"
        "extra-index-url = file:///idx/one\n  file:///idx/two\n"
        "find-links = /from/file\n"
        "constraint = /c/one.txt /c/two.txt\n"
        "no-index = yes\n"
        "[install]\n"
        "index-url = https://install.example/simple\n"
    )
    env = _env(tmp_path, PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS="/from/env1 /from/env2")
    r = _run(env, "uv-args")
    assert r.returncode == 0, r.stderr
    pairs = _pairs(r.stdout)
    # pip compares versions over every index at once; uv's default takes the first index that
    # has a package (a local index with an old numpy would pin it)
    assert ("--index-strategy", "unsafe-best-match") in pairs
    # [install] beats [global]; a PIP_* variable beats the files (and replaces, not appends)
    assert [v for f, v in pairs if f == "--index-url"] == ["https://install.example/simple"]
    assert [v for f, v in pairs if f == "--find-links"] == ["/from/env1", "/from/env2"]
    assert [v for f, v in pairs if f == "--extra-index-url"] == [
        "file:///idx/one",
        "file:///idx/two",
    ]
    assert [v for f, v in pairs if f == "--constraints"] == ["/c/one.txt", "/c/two.txt"]
    assert ("--no-index", "") in pairs


def test_no_pip_config_leaves_uv_its_defaults(tmp_path: Path) -> None:
    env = _env(tmp_path, PIP_CONFIG_FILE=os.devnull)  # pip then reads no file at all
    r = _run(env, "uv-args")
    assert r.returncode == 0, r.stderr
    assert _pairs(r.stdout) == [("--index-strategy", "unsafe-best-match")]


def test_installer_forced_to_pip_or_refused(tmp_path: Path) -> None:
    r = _run(_env(tmp_path, ROLLPATCH_INSTALLER="pip"), "which")
    assert (r.returncode, r.stdout.strip()) == (0, "pip"), r.stderr
    assert not (tmp_path / "cache").exists()  # uv neither looked for nor fetched
    r = _run(_env(tmp_path, ROLLPATCH_INSTALLER="conda"), "which")
    assert r.returncode != 0
    assert "ROLLPATCH_INSTALLER must be uv or pip, not 'conda'" in r.stderr


def test_pip_when_uv_cannot_be_had(tmp_path: Path) -> None:
    """No index to fetch uv from (and none on PATH): one line says so, and pip is used."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = _env(
        tmp_path,
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(empty),
        PATH="/usr/bin:/bin",  # PYTHON names the interpreter; no uv here
    )
    r = _run(env, "which")
    assert (r.returncode, r.stdout.strip()) == (0, "pip"), r.stderr
    assert "could not be installed" in r.stderr and "installing with pip instead" in r.stderr
    assert not list((tmp_path / "cache").glob("uv-*/bin/uv"))  # nothing half-installed kept


@pytest.mark.parametrize("args", [[], ["frobnicate"]])
def test_usage_on_unknown_command(tmp_path: Path, args: list[str]) -> None:
    r = _run(_env(tmp_path), *args)
    assert r.returncode == 2
    assert "scripts/pyinstall install PYTHON ARG..." in r.stderr
