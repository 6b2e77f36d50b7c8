"""Router replay in the demo (``--model moe``): what the responses carried, and a replay check.

Every answer of an MoE island carries ``routed_experts`` (docs/moe.md): the experts each token
was routed to, ``[tokens, moe_layers, top_k]``, with ``rollpatch.spans`` saying which version
routed which rows. A trainer doing router replay (R3) trains on exactly those experts, so they
must be what the labelled version routes. Two checks:

- **carried**: every response has ``routed_experts`` of the expected shape (the demo's answers
  are one token, so the rows are the prompt's tokens: the generated token is never fed back),
  experts in range, and one span whose version is the response's label (drain commits);
- **replayed**: for a sample spread over islands and versions, Hugging Face transformers loads
  a checkpoint written from the labelled version's served bits (:class:`HFReplay`, the same
  check ``tests/test_moe.py`` makes), runs the prompt, and its routers' top-k must equal the
  response's rows, token by token and layer by layer. As a control, the same prompts are also
  routed under version 0, and the report says how many of them route differently there.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import shutil
import textwrap
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError
from ..view import View
from .grpo import Rollout

__all__ = [
    "REPLAY_SAMPLES",
    "HFReplay",
    "RoutingReport",
    "Views",
    "check_routing",
    "decode_routed_experts",
    "moe_layers",
    "pick_spread",
    "routing_invariant",
    "routing_line",
]

#: Responses whose routing is replayed by transformers (spread over islands and versions).
REPLAY_SAMPLES = 16
#: Served kinds whose words transformers can load as they are.
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def decode_routed_experts(text: str) -> np.ndarray:
    """vLLM's wire form of ``routed_experts`` (base64 of ``.npy`` bytes) → the array."""
    try:
        arr = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise ConfigError("routed_experts is not base64 of .npy bytes", error=str(e)) from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 3 or arr.dtype.kind != "u":
        raise ConfigError("routed_experts must be an unsigned [tokens, layers, top_k] array")
    return arr


class HFReplay:
    """transformers' own forward pass under a served view: the routing it computes.

    Writes ``dest/model.safetensors`` from the view's bits (the model's config copied from
    ``model_dir``) and loads it with ``AutoModelForCausalLM.from_pretrained``, so the
    checkpoint's per-expert names go through transformers' own loading, not rollpatch's.
    Routing is the top-k of each router's softmax (Qwen3-MoE, Mixtral).
    """

    def __init__(self, model_dir: str | Path, view: View, dest: str | Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "generation_config.json"):
            if (Path(model_dir) / f).exists():
                shutil.copy(Path(model_dir) / f, out / f)
        state = {}
        dtype = None
        for name, t in view.items():
            dtype = getattr(torch, _TORCH_DTYPES.get(t.kind.name, ""), None)
            if dtype is None:
                raise ConfigError(
                    "router replay loads bf16 or fp16 views only", tensor=name, kind=t.kind.name
                )
            words = torch.from_numpy(t.data.view(np.int16).copy())
            state[name] = words.view(dtype).reshape(t.shape)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        self.model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
        self.model.eval()
        self.top_k = int(self.model.config.num_experts_per_tok)

    def run(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(routing ``[len(tokens), layers, top_k]``, logits ``[len(tokens), vocab]``)."""
        import torch

        with torch.inference_mode():
            out = self.model(torch.tensor([list(tokens)]), output_router_logits=True)
        probs = [torch.softmax(x.float(), dim=-1) for x in out.router_logits]
        routes = np.stack([torch.topk(p, self.top_k, dim=-1).indices.numpy() for p in probs], 1)
        return routes, out.logits[0].float().numpy()


@dataclass
class RoutingReport:
    """What the routing checks found (``to_json`` is the report's ``routing`` key)."""

    layers: int
    top_k: int
    experts: int
    responses: int = 0
    carried: int = 0
    by_version: dict[int, dict[str, Any]] = field(default_factory=dict)
    shapes: Counter[str] = field(default_factory=Counter)
    problems: list[dict[str, Any]] = field(default_factory=list)
    replayed: int = 0
    replay_tokens: int = 0
    replay_mismatches: list[dict[str, Any]] = field(default_factory=list)
    control: int = 0
    control_differ: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {"moe_layers": self.layers, "experts": self.experts, "top_k": self.top_k},
            "responses": self.responses,
            "with_routed_experts": self.carried,
            "shapes": dict(self.shapes),
            "by_version": {str(v): d for v, d in sorted(self.by_version.items())},
            "problems": len(self.problems),
            "first_problems": self.problems[:5],
            "replayed": self.replayed,
            "replayed_tokens": self.replay_tokens,
            "replay_mismatches": len(self.replay_mismatches),
            "first_replay_mismatches": self.replay_mismatches[:5],
            "control_replayed": self.control,
            "control_differ": self.control_differ,
        }


def moe_layers(config: dict[str, Any]) -> int:
    """Sparse layers of a transformers MoE config (Qwen-MoE's ``decoder_sparse_step`` and
    ``mlp_only_layers``; Mixtral: every layer)."""
    n = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    return sum(1 for i in range(n) if i not in dense and (i + 1) % step == 0)


def pick_spread(rollouts: Sequence[Rollout], limit: int) -> list[Rollout]:
    """Up to ``limit`` rollouts, one per (version, island), spread evenly over the versions."""
    buckets: dict[tuple[int, str], Rollout] = {}
    for r in rollouts:
        buckets.setdefault((r.version, r.island), r)
    keys = sorted(buckets)
    if len(keys) > limit:
        keys = [keys[int(i)] for i in np.unique(np.linspace(0, len(keys) - 1, limit).round())]
    return [buckets[k] for k in keys]


def _carried(r: Rollout, rep: RoutingReport, per: dict[str, Any]) -> np.ndarray | None:
    """The rollout's routing if it is well formed and labelled; else a problem is noted."""
    problem = None
    rows = None
    if r.routed_experts is None:
        problem = "no routed_experts in the response"
    else:
        rep.carried += 1
        per["with_routed_experts"] += 1
        try:
            rows = decode_routed_experts(r.routed_experts)
        except ConfigError as e:
            problem = str(e)
    if rows is not None:
        want = (len(r.prompt), rep.layers, rep.top_k)
        shape = "x".join(map(str, rows.shape))
        rep.shapes[shape] += 1
        per["shapes"][shape] = per["shapes"].get(shape, 0) + 1
        if rows.shape != want:
            problem = f"shape {list(rows.shape)} != {list(want)}"
        elif int(rows.max(initial=0)) >= rep.experts:
            problem = f"expert index {int(rows.max())} >= {rep.experts}"
        elif r.spans != ((0, len(rows), r.version),):
            problem = f"spans {list(r.spans)} are not one span of version {r.version}"
    if problem is not None:
        rep.problems.append({"problem": problem, "island": r.island, "version": r.version})
        return None
    return rows


class Views(Protocol):
    """Served views by version (a :class:`~rollpatch.demo.verify.ViewHistory`, or a dict)."""

    def get(self, version: int, /) -> View | None: ...


def check_routing(
    model_dir: str | Path,
    views: Views,
    rollouts: Sequence[Rollout],
    sample: Sequence[Rollout],
    workdir: str | Path,
) -> RoutingReport:
    """Both checks (module doc): every response in ``rollouts`` is checked for what it carried,
    and those in ``sample`` are replayed under ``views.get(version)``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    rep = RoutingReport(
        layers=moe_layers(cfg),
        top_k=int(cfg["num_experts_per_tok"]),
        experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
    )
    good: dict[int, list[tuple[Rollout, np.ndarray]]] = defaultdict(list)
    chosen = {id(r) for r in sample}
    for r in rollouts:
        rep.responses += 1
        per = rep.by_version.setdefault(
            r.version, {"responses": 0, "with_routed_experts": 0, "shapes": {}}
        )
        per["responses"] += 1
        rows = _carried(r, rep, per)
        if rows is not None and id(r) in chosen:
            good[r.version].append((r, rows))
    first = min(rep.by_version, default=0)
    for v in sorted(good):
        hf = HFReplay(model_dir, _view(views, v), Path(workdir) / f"v{v}")
        for r, rows in good[v]:
            routed, _ = hf.run(r.prompt)
            rep.replayed += 1
            rep.replay_tokens += len(rows)
            bad = [i for i in range(len(rows)) if not np.array_equal(rows[i], routed[i])]
            if bad:
                rep.replay_mismatches.append(
                    {"island": r.island, "version": v, "seed": r.seed, "tokens": bad[:8]}
                )
    controls = [(r, rows) for v in sorted(good) if v != first for r, rows in good[v]]
    if controls:
        hf = HFReplay(model_dir, _view(views, first), Path(workdir) / f"v{first}-control")
        for r, rows in controls:
            rep.control += 1
            rep.control_differ += int(not np.array_equal(hf.run(r.prompt)[0], rows))
    return rep


def _view(views: Views, version: int) -> View:
    view = views.get(version)
    if view is None:
        raise ConfigError("no served view of a version to replay", version=version)
    return view


# -- the report ----------------------------------------------------------------------------


def routing_invariant(rt: dict[str, Any] | None, ver: dict[str, Any]) -> dict[str, Any]:
    """MoE: every response carried its routing, labelled; transformers replays a sample."""
    if rt is None:
        if "skipped" in ver:
            return {"ok": None, "detail": ver["skipped"]}
        return {"ok": False, "detail": "the trainer sent no routing report"}
    n, carried = int(rt["responses"]), int(rt["with_routed_experts"])
    ok = (
        n > 0
        and carried == n
        and rt["problems"] == 0
        and rt["replayed"] > 0
        and rt["replay_mismatches"] == 0
    )
    detail = (
        f"{carried} of {n} responses carried routed_experts (tokens x layers x top-k: "
        + ", ".join(f"{k} in {v}" for k, v in sorted(rt["shapes"].items()))
        + f"), {n - rt['problems']} well formed with one span of their labelled version; "
        f"transformers replayed {rt['replayed']} of them ({rt['replayed_tokens']} tokens) under "
        f"the labelled version: {rt['replay_mismatches']} differ; control: "
        f"{rt['control_differ']}/{rt['control_replayed']} route differently under the first "
        "version"
    )
    if rt["problems"]:
        detail += f"; first problems: {rt['first_problems'][:2]}"
    return {"ok": ok, "detail": detail}


def routing_line(rt: dict[str, Any]) -> str:
    """Routing carried per version: compact when every response carried it (the counts per
    version are in the JSON), else each version that lacked some."""
    m = rt["model"]
    per = sorted(((int(v), d) for v, d in rt["by_version"].items()), key=lambda vd: vd[0])
    short = [(v, d) for v, d in per if d["with_routed_experts"] < d["responses"]]
    counts = [d["responses"] for _, d in per] or [0]
    shapes = ", ".join(f"{k} ({n})" for k, n in sorted(rt["shapes"].items())) or "none"
    where = (
        f"every version v{per[0][0]}..v{per[-1][0]} ({min(counts)}-{max(counts)} responses "
        "each; per version in the JSON)"
        if per and not short
        else "missing in "
        + ", ".join(
            f"v{v} ({d['responses'] - d['with_routed_experts']} of {d['responses']})"
            for v, d in short
        )
    )
    return textwrap.fill(
        f"routing  {m['experts']} experts, top-{m['top_k']}, {m['moe_layers']} MoE layers; "
        f"routed_experts in {rt['with_routed_experts']} of {rt['responses']} responses: {where}; "
        f"shape tokens x layers x top-k {shapes}",
        width=100,
        subsequent_indent=" " * 9,
    )
