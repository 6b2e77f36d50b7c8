"""CLI flags are made from the configs' own fields (rollpatch.config, rollpatch.cli.flags).

Every field of a service's config has a flag, or is named as set another way (a secret read
from a file, a nested config, the serving flags); each flag's default is the config's default,
so a default is written once; the flags users had keep their names and defaults; a bad value
given to a flag is refused by the config, in one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from rollpatch.cli import build_parser, main
from rollpatch.cli.demo import CODEC_SHARED, DEMO_MODE_DEFAULTS, CodecWalk, walk_config
from rollpatch.cli.flags import config_kwargs, flag_name
from rollpatch.cli.gateway import GATEWAY_SET_OTHERWISE
from rollpatch.cli.publish import PUBLISH_SET_OTHERWISE
from rollpatch.cli.pull import PULL_UNUSED
from rollpatch.cli.relay import RELAY_SET_OTHERWISE
from rollpatch.cli.sidecar import (
    FOLLOWER_FLAGS,
    FOLLOWER_SET_OTHERWISE,
    FOLLOWER_UNSET,
    SIDECAR_SET_OTHERWISE,
)
from rollpatch.config import settings
from rollpatch.demo.config import DemoConfig
from rollpatch.follower import FollowerConfig
from rollpatch.formats import QuantPolicy
from rollpatch.gateway import GatewayConfig
from rollpatch.netem.cli import config_from_args
from rollpatch.netem.config import LinkConfig
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
    ("publish", ["ck", "--board", "b", "--run", "r"], QuantPolicy, {}),
    ("cast", ["ck", "-o", "o"], QuantPolicy, {}),
    ("diff", ["a", "b", "-o", "o"], QuantPolicy, {}),
    ("analyze", ["a", "b"], QuantPolicy, {}),
    ("demo", [], DemoConfig, {}),
    ("demo", ["--codec-only"], CodecWalk, {}),  # --steps, --lr, --out, --seed: the demo's
    ("netem", ["--upstream", "h:1"], LinkConfig, {}),
]
IDS = [f"{c}-{cls.__name__}" for c, _, cls, _ in COMMANDS]

#: (command, config) → field → its flag there, where that is not the declared one.
RENAMED: dict[tuple[str, type], dict[str, str]] = {("sidecar", FollowerConfig): FOLLOWER_FLAGS}
#: (command, config) → fields whose flag defaults to none, so that the mode's config fills it
#: (``demo --steps``: 50 steps of RL, 4 of the codec walk-through).
UNSET: dict[tuple[str, type], tuple[str, ...]] = {
    ("demo", DemoConfig): DEMO_MODE_DEFAULTS,
    ("demo", CodecWalk): CODEC_SHARED,
    ("sidecar", FollowerConfig): FOLLOWER_UNSET,
}
#: Arguments a config requires that no flag of the command gives.
REQUIRED: dict[type, dict[str, Any]] = {
    RelayConfig: {"cache_dir": Path("c")},
    LinkConfig: {"upstream": ("h", 1)},  # built by the command's config_from_args
}

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
    # --include/--exclude were lists ([]), --engine-urls and --formats strings parsed by the
    # command ("", "bf16,..."), --listen a "HOST:PORT" string: each flag now parses its value,
    # so its default is the parsed one; --no-live, --no-sign and --no-handshake were
    # store_true flags of a False default: the same switches, on by default
    "cast": {"--format": "bf16", "--scales": "bf16", "--include": (), "--exclude": ()},
    "diff": {"--format": "bf16", "--scales": "bf16", "--include": (), "--exclude": ()},
    "analyze": {"--scales": "bf16", "--include": (), "--exclude": ()},
    "demo": {
        "--steps": None,
        "--max-lag": 2,
        "--format": "bf16",
        "--wan-mbps": 10.0,
        "--wan-latency-ms": 100.0,
        "--out": None,
        "--json": None,
        "--seed": 0,
        "--no-live": True,
        "--engine": "reference",
        "--engine-urls": (),
        "--prompts-per-step": 16,
        "--group-size": 8,
        "--regime": "fast",
        "--lr": None,
        "--hidden": 128,
        "--model": "dense",
        "--verify-samples": 0,
        "--codec-only": False,
        "--params": 20e6,
        "--formats": ("bf16", "fp8-e4m3-block128", "nvfp4"),
        "--no-sign": True,
    },
    "netem": {
        "--listen": ("127.0.0.1", 0),
        "--latency-ms": 0.0,
        "--mbps": None,
        "--loss": 0.0,
        "--max-connections": 256,
        "--window-kb": None,
        "--no-handshake": True,
        "--seed": None,
    },
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
    renamed, unset = RENAMED.get((command, cls), {}), UNSET.get((command, cls), ())
    for name, d in declared.items():
        if name in otherwise:
            assert flag_name(d) not in flags, name
            continue
        action = flags.get(renamed.get(name, flag_name(d)))
        assert action is not None, f"rollpatch {command}: no flag for {cls.__name__}.{name}"
        if d.default is dataclasses.MISSING:
            assert action.required, name
        elif name in unset:  # none, or the same default: the config's applies (test below)
            assert action.default in (None, d.default), name
            continue
        else:
            assert action.default == d.default, (name, action.default, d.default)
        assert d.setting.help in (action.help or "").replace("%%", "%"), name


@pytest.mark.parametrize("command, required, cls, otherwise", COMMANDS, ids=IDS)
def test_no_flags_build_the_default_config(
    command: str, required: list[str], cls: type, otherwise: dict[str, str]
) -> None:
    args = _command(command).parse_args(required)
    kwargs = config_kwargs(args, cls)
    unset = UNSET.get((command, cls), ())
    if cls is CodecWalk:  # its own flags, then the demo's shared ones
        assert set(kwargs) == set(settings(cls)) - set(CODEC_SHARED)
        assert walk_config(args) == CodecWalk()
        return
    assert set(kwargs) == set(settings(cls)) - set(otherwise) - set(unset)
    extra = REQUIRED.get(cls, {})
    default = cls(**extra)
    # netem reads HOST:PORT itself (a malformed one: refused by the command, in one line)
    built = config_from_args(args) if cls is LinkConfig else cls(**{**extra, **kwargs})
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
            "argument --max-attempts: must be an integer in [1, 16]",
        ),
        (
            ["gateway", "--sidecar", "http://127.0.0.1:1", "--port", "0", "--poll", "nan"],
            "argument --poll: must be a finite number",
        ),
        (
            ["pull", "--board", "{board}", "--run", "r", "-o", "{out}", "--workers", "0"],
            "argument --workers: must be an integer in [1, 256]",
        ),
        (["demo", "--model", "moe", "--top-k", "9"], "DemoConfig.top_k must be at most experts"),
        (["demo", "--hidden", "8"], "argument --hidden: must be an integer in [16, 4096]"),
        (["demo", "--codec-only", "--formats", "bf16,nope"], "CodecWalk.formats must name"),
        (
            ["demo", "--engine-urls", "http://a", "--steps", "1"],
            "--engine-urls needs --engine vllm",
        ),
        (["demo", "--codec-only", "--regime", "real"], "--codec-only does not use --regime"),
        (["netem", "--upstream", "h:1", "--loss", "0.9"], "argument --loss: must be"),
    ],
)
def test_a_bad_flag_value_is_refused_by_the_config_in_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value one field's own bounds refuse is refused while the flags are parsed, by the
    flag's name; a rule across fields, by the config (naming its fields)."""
    argv = [a.format(board=tmp_path, out=tmp_path / "v.safetensors") for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusal of the flag
        code = int(e.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert not (tmp_path / "v.safetensors").exists()


@pytest.mark.parametrize("field", sorted(FOLLOWER_FLAGS))
def test_the_sidecars_old_fetch_flags_still_work_with_a_one_line_warning(
    field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sidecar's fetch flags say what they are (--fetch-timeout beside --header-timeout);
    the old names, shared with ``pull``, still set the same field, with one warning line."""
    parser = _command("sidecar")
    old, new = flag_name(settings(FollowerConfig)[field]), FOLLOWER_FLAGS[field]
    base = ["--board", "b", "--run", "r"]
    by_old = FollowerConfig(**config_kwargs(parser.parse_args([*base, old, "7"]), FollowerConfig))
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rollpatch sidecar: warning: {old} is deprecated; use {new}"
    ]
    by_new = FollowerConfig(**config_kwargs(parser.parse_args([*base, new, "7"]), FollowerConfig))
    assert capsys.readouterr().err == ""
    assert getattr(by_old, field) == getattr(by_new, field) == 7
    assert getattr(FollowerConfig(), field) != 7
    usage = parser.format_help()
    assert new in usage and not re.search(rf"(?<![\w-]){old}\b", usage)  # hidden
    assert old in _flags(_command("pull"))  # pull keeps its names


def test_the_demo_modes_fill_their_own_defaults() -> None:
    """--steps, --out, --lr and --seed serve the RL demo and the codec walk-through; given,
    they set both; not given, each mode's config has its own default."""
    parser = _command("demo")
    assert DemoConfig(**config_kwargs(parser.parse_args([]), DemoConfig)) == DemoConfig()
    assert walk_config(parser.parse_args(["--codec-only"])) == CodecWalk()
    assert (DemoConfig().steps, CodecWalk().steps) == (50, 4)
    args = parser.parse_args(["--steps", "3", "--out", "o", "--lr", "1e-5", "--seed", "2"])
    rl, walk = DemoConfig(**config_kwargs(args, DemoConfig)), walk_config(args)
    assert (rl.steps, rl.out, rl.lr, rl.seed) == (walk.steps, walk.out, walk.lr, walk.seed)
    assert (walk.steps, walk.out, walk.lr, walk.seed) == (3, "o", 1e-5, 2)
    real = DemoConfig(**config_kwargs(parser.parse_args(["--regime", "real"]), DemoConfig))
    assert real.lr == 1.5e-6  # no --lr: the regime's rate
    args = parser.parse_args(["--engine-urls", "http://a, http://b,http://c", "--no-live"])
    cfg = DemoConfig(**{**config_kwargs(args, DemoConfig), "engine": "vllm"})
    assert cfg.engine_urls == ("http://a", "http://b", "http://c") and not cfg.live


def test_the_codec_commands_choose_the_router_policy() -> None:
    """``quantise_routers`` has a flag wherever a quantisation policy is chosen."""
    from rollpatch.cli.codec import policy_from_args

    for command, required in (
        ("cast", ["ck", "-o", "o"]),
        ("diff", ["a", "b", "-o", "o"]),
        ("analyze", ["a", "b"]),
        ("publish", ["ck", "--board", "b", "--run", "r"]),
    ):
        parser = _command(command)
        assert policy_from_args(parser.parse_args(required)) == QuantPolicy()
        args = parser.parse_args(
            [*required, "--quantise-routers", "--include", "*.mlp.*", "--include", "x"]
        )
        assert policy_from_args(args) == QuantPolicy(
            include=("*.mlp.*", "x"), quantise_routers=True
        )
        assert policy_from_args(args).quantise("model.layers.0.mlp.gate.weight", (8, 64))
