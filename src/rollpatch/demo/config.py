"""The demo's settings: one validated, JSON-serialisable dataclass shared by every process."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

from ..errors import ConfigError

__all__ = ["ISLANDS", "RUN", "DemoConfig", "DemoModel", "Regime"]

#: The RL phase's regime (docs/demo.md): ``fast``, a policy that only learned the answer
#: format, trained at a high learning rate so the reward climbs within ~50 steps (each step
#: changes ~50% of the served BF16 values); ``real``, the learning rate of RL post-training
#: on a policy warmed up by an unpublished supervised phase (a few % change per step).
Regime = Literal["fast", "real"]

#: The policy model's architecture: ``dense``, a tiny Llama; ``moe``, a tiny Qwen3-MoE whose
#: every response carries the experts each token was routed to (``routed_experts``,
#: docs/moe.md), checked against transformers' own routing under the labelled version.
DemoModel = Literal["dense", "moe"]

#: The run name on the demo's board.
RUN = "demo"
#: The three rollout islands: name → region. ``local`` reads the board directly; the others
#: read through their region's relay, whose upstream link is emulated (rollpatch.netem).
ISLANDS: tuple[tuple[str, str | None], ...] = (("local", None), ("eu", "eu"), ("us", "us"))


def _int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(
            f"DemoConfig.{name} must be an integer in [{lo}, {hi}]", field=name, value=value
        )


def _num(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > lo if lo_open else value >= lo)
        and value <= hi
    )
    if not ok:
        raise ConfigError(
            f"DemoConfig.{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]",
            field=name,
            value=value,
        )


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything one ``rollpatch demo`` run needs (validated in ``__post_init__``)."""

    #: Optimizer steps; the trainer publishes one version after each (version n = n steps).
    steps: int = 50
    #: Bounded staleness K: requests carry ``max_lag=K``; rollouts older than K versions when
    #: the trainer consumes them are dropped.
    max_lag: int = 2
    #: Served format published by the trainer (the reference engine serves bf16 and fp16).
    format: str = "bf16"
    #: Emulated WAN between the board and each remote relay: bandwidth (Mbit/s) ...
    wan_mbps: float = 10.0
    #: ... and added round-trip latency per upstream request (ms).
    wan_latency_ms: float = 100.0
    #: Output directory (board, relay caches, model, logs, plots, summary.json).
    out: str = "out/demo"
    #: Extra path for the JSON report (it is always written to ``out/summary.json`` too).
    json_path: str | None = None
    #: Seeds the model, the warm-up, prompts and per-request sampling seeds.
    seed: int = 0
    #: Redraw a status block in place (False: one plain log line per step).
    live: bool = True
    #: Rollout engine of every island: ``reference`` (built in, CPU) or ``vllm``.
    engine: str = "reference"
    #: vLLM only: one OpenAI base URL per island (local, eu, us), each serving ``out/model``.
    engine_urls: tuple[str, ...] = ()
    #: Prompts per step (GRPO groups) and samples per prompt (the group size G).
    prompts_per_step: int = 16
    group_size: int = 8
    #: Regime of the RL phase (see :data:`Regime`); decides the warm-up.
    regime: Regime = "fast"
    #: AdamW learning rate of the RL phase (fast: 2e-4, far above RL post-training rates on
    #: purpose; real: 1.5e-6; see docs/demo.md).
    lr: float = 2e-4
    #: PPO/GRPO ratio clip epsilon.
    clip: float = 0.2
    #: Tiny model shape: hidden size, layers, vocabulary (dense: intermediate = 2 x hidden;
    #: moe: each expert's intermediate = hidden / 2).
    hidden: int = 128
    layers: int = 2
    vocab: int = 512
    #: Architecture of the policy (see :data:`DemoModel`).
    model: DemoModel = "dense"
    #: ``moe`` only: routed experts per sparse layer, and experts each token is routed to.
    experts: int = 8
    top_k: int = 2
    #: Supervised format warm-up steps before version 0 (random digit answers; see docs).
    warmup_steps: int = 30
    #: Concurrent rollout requests in flight through the gateway.
    concurrency: int = 16
    #: Rollouts re-generated in the trainer to check version labels (0: all of them).
    verify_samples: int = 0
    #: Follower poll period of each island, seconds.
    poll_s: float = 0.1
    #: Longest wait for every island to reach LATEST after the last step, seconds.
    catchup_timeout_s: float = 120.0
    #: Sign the board (an Ed25519 key and a root of trust made for the run; relays and islands
    #: verify under it, docs/trust.md). False: an unsigned board, verification off.
    sign: bool = True

    def __post_init__(self) -> None:
        from ..formats import FORMAT_NAMES

        _int("steps", self.steps, 1, 100_000)
        _int("max_lag", self.max_lag, 0, 1000)
        if self.format not in FORMAT_NAMES:
            raise ConfigError(
                "DemoConfig.format is not a known format",
                field="format",
                value=self.format,
                hint=f"one of {', '.join(FORMAT_NAMES)}",
            )
        _num("wan_mbps", self.wan_mbps, 0.0, 1e6, lo_open=True)
        _num("wan_latency_ms", self.wan_latency_ms, 0.0, 60_000.0)
        if not isinstance(self.out, str) or not self.out:
            raise ConfigError("DemoConfig.out must be a directory path", field="out")
        _int("seed", self.seed, 0, 2**31 - 1)
        if self.engine not in ("reference", "vllm"):
            raise ConfigError(
                "DemoConfig.engine must be reference or vllm", field="engine", value=self.engine
            )
        object.__setattr__(self, "engine_urls", tuple(self.engine_urls))
        if self.engine == "vllm" and len(self.engine_urls) != len(ISLANDS):
            raise ConfigError(
                f"--engine vllm needs {len(ISLANDS)} engine URLs (one per island: local, eu, us)",
                field="engine_urls",
                hint="--engine-urls http://H:P1,http://H:P2,http://H:P3",
            )
        if self.engine == "reference" and self.format not in ("bf16", "fp16"):
            raise ConfigError(
                f"the reference engine serves bf16 or fp16, not {self.format}",
                field="format",
                hint="use --engine vllm for quantised formats",
            )
        _int("prompts_per_step", self.prompts_per_step, 1, 4096)
        _int("group_size", self.group_size, 2, 256)
        if self.regime not in get_args(Regime):
            raise ConfigError(
                "DemoConfig.regime must be fast or real", field="regime", value=self.regime
            )
        _num("lr", self.lr, 0.0, 1.0, lo_open=True)
        _num("clip", self.clip, 0.0, 1.0, lo_open=True)
        _int("hidden", self.hidden, 16, 4096)
        if self.hidden % 4:
            raise ConfigError(
                "DemoConfig.hidden must be a multiple of 4 (4 heads)",
                field="hidden",
                value=self.hidden,
            )
        _int("layers", self.layers, 1, 64)
        if self.model not in get_args(DemoModel):
            raise ConfigError(
                "DemoConfig.model must be dense or moe", field="model", value=self.model
            )
        _int("experts", self.experts, 2, 256)
        _int("top_k", self.top_k, 1, self.experts)
        if self.model == "moe" and self.engine != "reference":
            raise ConfigError(
                "--model moe runs on the built-in engine only",
                field="model",
                hint="vLLM on CPU returns no routed experts (docs/moe.md); use --engine reference",
            )
        _int("vocab", self.vocab, 300, 65_536)
        _int("warmup_steps", self.warmup_steps, 0, 10_000)
        _int("concurrency", self.concurrency, 1, 256)
        _int("verify_samples", self.verify_samples, 0, 10_000_000)
        _num("poll_s", self.poll_s, 0.0, 60.0, lo_open=True)
        _num("catchup_timeout_s", self.catchup_timeout_s, 0.0, 3600.0, lo_open=True)
        if not isinstance(self.sign, bool):
            raise ConfigError("DemoConfig.sign must be true or false", field="sign")

    @property
    def batch_rollouts(self) -> int:
        """Rollouts the trainer consumes per step."""
        return self.prompts_per_step * self.group_size

    def to_json(self) -> str:
        """The config as a JSON object (what child processes receive)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DemoConfig:
        """Inverse of :meth:`to_json` (unknown keys are refused)."""
        raw: Any = json.loads(text)
        if not isinstance(raw, dict):
            raise ConfigError("demo config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError("unknown demo config keys", keys=unknown)
        if "engine_urls" in raw:
            raw["engine_urls"] = tuple(raw["engine_urls"])
        return cls(**raw)
