"""The demo's settings: one validated, JSON-serialisable dataclass shared by every process."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from ..config import check_fields, setting
from ..errors import ConfigError
from ..formats import FORMAT_NAMES

__all__ = ["ISLANDS", "REGIME_LR", "RUN", "DemoConfig", "DemoEngine", "DemoModel", "Regime"]

#: The RL phase's regime (docs/demo.md): ``fast``, a policy that only learned the answer
#: format, trained at a high learning rate so the reward climbs within ~50 steps (each step
#: changes ~50% of the served BF16 values); ``real``, the learning rate of RL post-training
#: on a policy warmed up by an unpublished supervised phase (a few % change per step).
Regime = Literal["fast", "real"]
#: The RL phase's learning rate in each regime, when ``DemoConfig.lr`` is not given: fast, far
#: above RL post-training rates on purpose; real, a post-training rate (docs/demo.md).
REGIME_LR: dict[str, float] = {"fast": 2e-4, "real": 1.5e-6}

#: The policy model's architecture: ``dense``, a tiny Llama; ``moe``, a tiny Qwen3-MoE whose
#: every response carries the experts each token was routed to (``routed_experts``,
#: docs/moe.md), checked against transformers' own routing under the labelled version.
DemoModel = Literal["dense", "moe"]

#: The islands' rollout engine: ``reference``, the built-in CPU engine; ``vllm``, one vLLM
#: server per island (``engine_urls``).
DemoEngine = Literal["reference", "vllm"]

#: The run name on the demo's board.
RUN = "demo"
#: The three rollout islands: name → region. ``local`` reads the board directly; the others
#: read through their region's relay, whose upstream link is emulated (rollpatch.netem).
ISLANDS: tuple[tuple[str, str | None], ...] = (("local", None), ("eu", "eu"), ("us", "us"))


def url_list(text: str) -> tuple[str, ...]:
    """``"http://a,http://b"`` → ``("http://a", "http://b")`` (the ``--engine-urls`` flag)."""
    return tuple(u.strip() for u in text.split(",") if u.strip())


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything one ``rollpatch demo`` run needs. Every field is declared with
    :func:`~rollpatch.config.setting` and checked by :func:`~rollpatch.config.check_fields`;
    the rules between fields follow in ``__post_init__``. ``rollpatch demo``'s flags are made
    from these fields (:mod:`rollpatch.cli.flags`)."""

    steps: int = setting(
        50,
        lo=1,
        hi=100_000,
        help="training steps; the trainer publishes one version after each (version n = n steps)",
    )
    max_lag: int = setting(
        2,
        lo=0,
        hi=1000,
        help="staleness bound K: requests carry max_lag=K, older rollouts are dropped",
    )
    format: str = setting(
        "bf16",
        choices=FORMAT_NAMES,
        help="served format the trainer publishes (the reference engine serves bf16 and fp16)",
    )
    wan_mbps: float = setting(
        10.0,
        lo=0.0,
        lo_open=True,
        hi=1e6,
        help="emulated WAN bandwidth board -> each remote relay (Mbit/s)",
    )
    wan_latency_ms: float = setting(
        100.0,
        lo=0.0,
        hi=60_000.0,
        help="emulated WAN round trip added (ms; half each way, real TCP through rollpatch.netem)",
    )
    out: str = setting(
        "out/demo",
        metavar="DIR",
        help="output directory, reset on every run (board, relay caches, model, logs, plots, "
        "summary.json)",
    )
    json_path: str | None = setting(
        None,
        flag="--json",
        metavar="PATH",
        help="also write the JSON report here (besides OUT/summary.json)",
    )
    seed: int = setting(
        0,
        lo=0,
        hi=2**31 - 1,
        help="seeds the model, the warm-up, prompts and per-request sampling seeds",
    )
    live: bool = setting(
        True, help="redraw a live status block in place (--no-live: one plain line per step)"
    )
    engine: DemoEngine = setting("reference", help="rollout engine of the islands")
    engine_urls: tuple[str, ...] = setting(
        (),
        parse=url_list,
        metavar="URLS",
        help="--engine vllm: three comma-separated OpenAI base URLs (local,eu,us), each "
        "serving OUT/model",
    )
    prompts_per_step: int = setting(16, lo=1, hi=4096, help="GRPO groups per step")
    group_size: int = setting(8, lo=2, hi=256, help="samples per prompt (G)")
    regime: Regime = setting(
        "fast",
        help="fast: format warm-up only, high learning rate, reward climbs within ~50 steps, "
        "~50% of the BF16 values change per step; real: an unpublished supervised warm-up, "
        "then RL at a post-training learning rate (a few % change per step; the reward moves "
        "slowly: docs/demo.md)",
    )
    lr: float | None = setting(
        None,
        lo=0.0,
        lo_open=True,
        hi=1.0,
        help="AdamW learning rate of the RL phase (none: the regime's, fast "
        f"{REGIME_LR['fast']:g}, real {REGIME_LR['real']:g}; docs/demo.md)",
    )
    clip: float = setting(0.2, lo=0.0, lo_open=True, hi=1.0, help="PPO/GRPO ratio clip epsilon")
    hidden: int = setting(
        128, lo=16, hi=4096, help="tiny model hidden size (a multiple of 4: 4 heads)"
    )
    layers: int = setting(2, lo=1, hi=64, help="tiny model layers")
    vocab: int = setting(512, lo=300, hi=65_536, help="tiny model vocabulary")
    model: DemoModel = setting(
        "dense",
        help="dense: a tiny Llama; moe: a tiny Qwen3-MoE whose responses carry routed_experts, "
        "replayed by transformers under their labelled versions",
    )
    experts: int = setting(8, lo=2, hi=256, help="--model moe: routed experts per sparse layer")
    top_k: int = setting(
        2, lo=1, hi=256, help="--model moe: experts each token is routed to (<= --experts)"
    )
    warmup_steps: int = setting(
        30, lo=0, hi=10_000, help="supervised format warm-up steps before version 0"
    )
    concurrency: int = setting(
        16, lo=1, hi=256, help="concurrent rollout requests in flight through the gateway"
    )
    verify_samples: int = setting(
        0, lo=0, hi=10_000_000, help="rollouts to re-generate for the label check (0: all)"
    )
    poll_s: float = setting(
        0.1, lo=0.0, lo_open=True, hi=60.0, help="seconds between each island's LATEST polls"
    )
    catchup_timeout_s: float = setting(
        120.0,
        lo=0.0,
        lo_open=True,
        hi=3600.0,
        help="seconds every island may take to reach LATEST after the last step",
    )
    sign: bool = setting(
        True,
        help="sign the board: a key and a trust root are made for the run; relays and islands "
        "verify every manifest and LATEST (--no-sign: an unsigned board)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_urls", tuple(self.engine_urls))
        check_fields(self)
        if not all(isinstance(u, str) and u for u in self.engine_urls):
            raise ConfigError(
                "DemoConfig.engine_urls must be non-empty URL strings",
                field="engine_urls",
                value=self.engine_urls,
            )
        if self.lr is None:  # the regime's rate (a JSON copy carries the number)
            object.__setattr__(self, "lr", REGIME_LR[self.regime])
        if self.engine == "reference" and self.engine_urls:
            raise ConfigError(
                "--engine-urls needs --engine vllm (the built-in engine runs in the demo's "
                "own islands)",
                field="engine_urls",
            )
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
        if self.hidden % 4:
            raise ConfigError(
                "DemoConfig.hidden must be a multiple of 4 (4 heads)",
                field="hidden",
                value=self.hidden,
            )
        if self.top_k > self.experts:
            raise ConfigError(
                f"DemoConfig.top_k must be at most experts ({self.experts})",
                field="top_k",
                value=self.top_k,
            )
        if self.model == "moe" and self.engine != "reference":
            raise ConfigError(
                "--model moe runs on the built-in engine only",
                field="model",
                hint="vLLM on CPU returns no routed experts (docs/moe.md); use --engine reference",
            )

    @property
    def rl_lr(self) -> float:
        """The RL phase's learning rate (``lr``, or the regime's when it was not given)."""
        return REGIME_LR[self.regime] if self.lr is None else self.lr

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
