"""CLI flags are made from the configs' own fields (rollpatch.config, rollpatch.cli.flags).

Every field of a service's config has a flag, or is named as set another way (a secret read
from a file, a nested config, the serving flags); each flag's default is the config's default,
so a default is written once; the flags users had keep their names and defaults; a bad value
given to a flag is refused by the config, in one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from rollpatch.cli import build_parser, main
from rollpatch.cli.flags import config_kwargs, flag_name
from rollpatch.cli.gateway import GATEWAY_SET_OTHERWISE
from rollpatch.cli.publish import PUBLISH_SET_OTHERWISE
from rollpatch.cli.pull import PULL_UNUSED
from rollpatch.cli.relay import RELAY_SET_OTHERWISE
from rollpatch.cli.sidecar import FOLLOWER_SET_OTHERWISE, SIDECAR_SET_OTHERWISE
from rollpatch.config import settings
from rollpatch.follower import FollowerConfig
from rollpatch.gateway import GatewayConfig
from rollpatch.publisher import PublisherConfig
from rollpatch.relay import RelayConfig
from rollpatch.serving import BodyLimits, ServeOptions
from rollpatch.sidecar import SidecarConfig

#: (command, its required arguments, a config it builds, the fields set another way)
COMMANDS: list[tuple[str, list[str], type, dict[str, str]]] = [
    ("sidecar", ["--board", "b", "--run", "r"], SidecarConfig, SIDECAR_SET_OTHERWISE),
    ("sidecar", ["--board", "b", "--run", "r"], FollowerConfig, FOLLOWER_SET_OTHERWISE),
    ("pull", ["--board", "b", "--run", "r", "-o", "o"], FollowerConfig, PULL_UNUSED),
    ("gateway", ["--sidecar", "http://h:1"], GatewayConfig, GATEWAY_SET_OTHERWISE),
    ("relay", ["--board", "b", "--cache", "c"], RelayConfig, RELAY_SET_OTHERWISE),
    ("publish", ["ck", "--board", "b", "--run", "r"], PublisherConfig, PUBLISH_SET_OTHERWISE),
]
IDS = [f"{c}-{cls.__name__}" for c, _, cls, _ in COMMANDS]

#: The flags as they were before they were made from the configs: names and defaults kept.
BEFORE: dict[str, dict[str, Any]] = {
    "sidecar": {"--poll": 0.5, "--commit-mode": "drain"},
    "pull": {"--workers": 4, "--retries": 3, "--timeout": 60.0},
    "gateway": {"--poll": 0.2, "--max-attempts": 3, "--connect-timeout": 2.0},
    "relay": {
        "--cache-bytes": 10 << 30,
        "--pointer-ttl": 0.5,
        "--list-ttl": 1.0,
        "--corrupt-ttl": 60.0,
        "--workers": 16,
    },
    "publish": {"--format": "bf16", "--scales": "bf16", "--keyframe-every": 50},
}


def _command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command, required, cls, otherwise", COMMANDS, ids=IDS)
def test_every_field_has_a_flag_with_the_configs_default(
    command: str, required: list[str], cls: type, otherwise: dict[str, str]
) -> None:
    declared = settings(cls)
    assert {f.name for f in dataclasses.fields(cls)} == set(declared), "declare with setting()"
    assert set(otherwise) <= set(declared), "a field named as set otherwise does not exist"
    flags = _flags(_command(command))
    for name, d in declared.items():
        if name in otherwise:
            assert flag_name(d) not in flags, name
            continue
        action = flags.get(flag_name(d))
        assert action is not None, f"rollpatch {command}: no flag for {cls.__name__}.{name}"
        if d.default is dataclasses.MISSING:
            assert action.required, name
        else:
            assert action.default == d.default, (name, action.default, d.default)
        assert d.setting.help in (action.help or "").replace("%%", "%"), name


@pytest.mark.parametrize("command, required, cls, otherwise", COMMANDS, ids=IDS)
def test_no_flags_build_the_default_config(
    command: str, required: list[str], cls: type, otherwise: dict[str, str]
) -> None:
    args = _command(command).parse_args(required)
    kwargs = config_kwargs(args, cls)
    assert set(kwargs) == set(settings(cls)) - set(otherwise)
    extra: dict[str, Any] = {"cache_dir": Path("c")} if cls is RelayConfig else {}
    default = cls(**extra)
    built = cls(**{**extra, **kwargs})
    for name in kwargs:
        if name != "publisher_id":  # hostname:pid, computed per instance
            assert getattr(built, name) == getattr(default, name), name


@pytest.mark.parametrize("command", sorted(BEFORE))
def test_the_flags_users_had_keep_their_names_and_defaults(command: str) -> None:
    flags = _flags(_command(command))
    for flag, default in BEFORE[command].items():
        assert flag in flags and flags[flag].default == default, flag


@pytest.mark.parametrize("command", ["sidecar", "gateway", "relay"])
def test_the_serving_flags_defaults_are_the_serving_configs(command: str) -> None:
    flags = _flags(_command(command))
    assert flags["--header-timeout"].default == ServeOptions().header_timeout_s
    if command != "relay":  # the relay reads no request bodies
        assert flags["--body-timeout"].default == BodyLimits().timeout_s
        assert flags["--max-body-bytes"].default == BodyLimits().max_bytes


def test_a_flag_sets_its_field() -> None:
    args = _command("gateway").parse_args(
        ["--sidecar", "http://h:1", "--poll", "0.5", "--retry-backoff", "0", "--max-attempts", "5"]
    )
    config = GatewayConfig(**config_kwargs(args, GatewayConfig))
    assert (config.poll_s, config.retry_backoff_s, config.max_attempts) == (0.5, 0.0, 5)
    args = _command("sidecar").parse_args(
        ["--board", "b", "--run", "r", "--drain-timeout", "none", "--audit-bytes-per-s", "none"]
    )
    assert SidecarConfig(**config_kwargs(args, SidecarConfig)).drain_timeout_s is None
    assert FollowerConfig(**config_kwargs(args, FollowerConfig)).audit_bytes_per_s is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["gateway", "--sidecar", "http://127.0.0.1:1", "--port", "0", "--max-attempts", "0"],
            "GatewayConfig.max_attempts must be an integer in [1, 16]",
        ),
        (
            ["gateway", "--sidecar", "http://127.0.0.1:1", "--port", "0", "--poll", "nan"],
            "GatewayConfig.poll_s must be a finite number",
        ),
        (
            ["pull", "--board", "{board}", "--run", "r", "-o", "{out}", "--workers", "0"],
            "FollowerConfig.fetch_workers must be an integer in [1, 256]",
        ),
    ],
)
def test_a_bad_flag_value_is_refused_by_the_config_in_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(board=tmp_path, out=tmp_path / "v.safetensors") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert not (tmp_path / "v.safetensors").exists()
