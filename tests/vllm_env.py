"""Helpers of the vLLM tests: the separate vLLM venv and a vLLM server (the synthetic layouts
of the offline tests: tests/vllm_layouts.py).

- The vLLM venv is built by ``scripts/vllm-env`` (cached at ``$ROLLPATCH_VLLM_VENV`` or
``~/.cache/rollpatch/vllm-venv-0.32.0``). The server runs this checkout's rollpatch whatever
checkout the venv was built from (``PYTHONPATH=<repo>/src``), bound to 127.0.0.1 only: dev mode
lets any caller run worker methods.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rollpatch.engines.process import EngineProcess
from rollpatch.view import View
from tests.s3server import free_port  # one picker of ports for servers

REPO = Path(__file__).resolve().parents[1]
#: For a server whose worker extension imports this checkout's tests too (the live tests'
#: hooks): ``start_server(..., env=REPO_ON_PATH)``.
REPO_ON_PATH = {"PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
VLLM_VERSION = "0.32.0"
BUILD_HINT = (
    "build it with `scripts/vllm-env` (≈2 min, ≈2.5 GB; cached), or set "
    "ROLLPATCH_SKIP_VLLM=1 to skip the vLLM tests"
)


def venv_dir() -> Path:
    """Where scripts/vllm-env puts the vLLM venv."""
    env = os.environ.get("ROLLPATCH_VLLM_VENV")
    if env is not None and env != "":
        return Path(env)
    return Path.home() / ".cache" / "rollpatch" / f"vllm-venv-{VLLM_VERSION}"


def vllm_python() -> Path | None:
    """The vLLM venv's python, or None when scripts/vllm-env has not completed there."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    stamp = venv / ".stamp-vllm"
    if not python.exists() or not stamp.exists() or VLLM_VERSION not in stamp.read_text():
        return None
    return python


def server_env(tp: int = 1) -> dict[str, str]:
    """The environment vLLM's CPU build needs (docs/vllm.md; ``tp`` ranks bound to this
    process's cores), bytecode written (:func:`write_bytecode`), the shm readers polling
    instead of spinning (:func:`poll_not_spin`)."""
    from rollpatch.engines.vllm.launch import server_env as launch_env

    return poll_not_spin(write_bytecode(launch_env(REPO / "src", tp=tp)))


def poll_not_spin(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``ROLLPATCH_VLLM_POLL_MS=1`` unless the caller's environment sets it (empty:
    vLLM's default busy loop, for A/B runs): vLLM's message-queue readers (the worker, the
    engine core) otherwise spin a core each for 1 s after every step and every rpc
    (rollpatch.engines.vllm.spin). Measured on the 2-core box, tests/test_vllm.py: see
    docs/vllm.md."""
    env.setdefault("ROLLPATCH_VLLM_POLL_MS", "1")
    return env


def write_bytecode(env: dict[str, str]) -> dict[str, str]:
    """``env`` without PYTHONDONTWRITEBYTECODE (which CI sets): an engine server's processes
    write the bytecode of what they import into the engine's venv (ours, under
    ROLLPATCH_CACHE), so the next server process reads it. The venv's import check compiles
    only what a server imports at start; the rest (in a cold CI run, SGLang: 680 modules read
    from source, its 267 model files among them; vLLM: 323) was compiled again in every
    server process that imports it: up to 2.2 s (SGLang) and 0.5 s (vLLM) of CPU each."""
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def random_versions(model_dir: Path, n: int, seed: int) -> list[View]:
    """The checkpoint in ``model_dir`` (v0), then ``n`` versions: each a small random step of
    FP32 masters (dense noise, mostly absorbed by BF16 rounding, as in RL), cast to BF16."""
    from rollpatch.formats import cast_view
    from rollpatch.io.safetensors import load_view

    v0 = load_view(model_dir / "model.safetensors")
    masters = {k: t.to_array().astype(np.float32) for k, t in v0.items()}
    rng = np.random.default_rng(seed)
    out = [v0]
    for _ in range(n):
        for m in masters.values():
            m += (3e-3 * float(m.std())) * rng.standard_normal(m.shape).astype(np.float32)
        out.append(cast_view(masters, "bf16"))
    return out


#: Per prompt: greedy token ids and their logprobs.
Outputs = list[tuple[list[int], list[float]]]


class Server(EngineProcess):
    """A running vLLM (or SGLang) OpenAI server: rollpatch's
    :class:`~rollpatch.engines.process.EngineProcess`, with the tests' requests."""

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def get(self, path: str, timeout: float = 30.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def greedy(self, model: Path, prompt_ids: list[list[int]], n: int = 8) -> Outputs:
        """Greedy tokens and their logprobs for each prompt (token ids in, ids out)."""
        out = []
        for ids in prompt_ids:
            r = self.post(
                "/v1/completions",
                {
                    "model": str(model),
                    "prompt": ids,
                    "max_tokens": n,
                    "temperature": 0,
                    "logprobs": 1,
                    "return_tokens_as_token_ids": True,
                    "ignore_eos": True,
                },
            )
            lp = r["choices"][0]["logprobs"]
            out.append(
                (
                    [int(t.split(":")[1]) for t in lp["tokens"]],
                    [float(x) for x in lp["token_logprobs"]],
                )
            )
        return out


def start_server(
    python: Path,
    model_dir: Path,
    log: Path,
    *,
    extra: list[str] | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    tp: int = 1,
) -> Server:
    """Start ``vllm.entrypoints.openai.api_server`` on 127.0.0.1 with the extension
    (``env``: variables set for the server on top of :func:`server_env`; ``tp`` > 1:
    ``--tensor-parallel-size``, the ranks bound to this process's cores)."""
    from rollpatch.engines.vllm.launch import server_command

    port = port or free_port()
    extra = [*(extra or ()), *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])]
    cmd = server_command(python, model_dir, port, weight_transfer=False, extra=extra)
    env = {**server_env(tp), **(env or {})}
    return Server(
        cmd, env=env, log=log, url=f"http://127.0.0.1:{port}", name="vLLM", cwd=log.parent
    )


class FakeVllm:
    """A scripted stand-in for the adapter's HTTP client: records every call, answers the
    rollpatch worker methods with what :meth:`script` says (for offline adapter tests)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.calls: list[tuple[str, Any]] = []
        self.result: dict[str, Any] = {}
        self.timeout = 30.0

    def script(
        self,
        ok: bool,
        digests: dict[str, str] | None = None,
        root: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        """The next commit's worker result; the engine then holds ``root`` (if given)."""
        self.result = {"ok": ok, "digests": digests, "root": root, "error": error}
        self.next_root = root

    def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        if path != "/collective_rpc":
            self.calls.append((path, body))
            return {}
        method = body["method"]
        self.calls.append((method, body["args"]))
        if method == "rollpatch_digest":
            return {"results": [{"ok": True, "digests": {}, "root": self.root}]}
        if method == "rollpatch_packed":  # an adoption's check: no CPU-packed experts here
            return {"results": [{"ok": True, "layers": 0, "mismatched": []}]}
        if method == "rollpatch_result":
            if self.next_root is not None:
                self.root = self.next_root
            return {"results": [self.result]}
        return {"results": [{"ok": True, "tensors": {}, "weight_transfer": "rollpatch"}]}

    def get(self, path: str, *, timeout: float | None = None) -> Any:
        return self.post(path)


def hf_checker(model_dir: Path) -> Callable[[View, list[list[int]], Outputs], int]:
    """A teacher-forced Hugging Face check of vLLM's greedy outputs on a view's weights.

    ``check(view, prompt_ids, outs)`` asserts HF's logprob of every vLLM token within 0.03 of
    vLLM's and of HF's best (greedy up to BF16 near-ties between two kernels), and returns how
    many tokens are exactly HF's argmax.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    def check(view: View, prompt_ids: list[list[int]], outs: Outputs) -> int:
        sd = {
            n: torch.from_numpy(t.data.view(np.int16).copy()).view(torch.bfloat16).reshape(t.shape)
            for n, t in view.items()
        }
        model.load_state_dict(sd, strict=True)
        exact = 0
        for ids, (toks, lps) in zip(prompt_ids, outs):
            with torch.no_grad():
                logits = model(torch.tensor([ids + toks])).logits[0].float()
            logp = torch.log_softmax(logits[len(ids) - 1 : -1], -1)
            hf = logp[torch.arange(len(toks)), torch.tensor(toks)]
            assert np.allclose(hf.numpy(), lps, atol=0.03), (hf, lps)
            assert bool((hf >= logp.max(-1).values - 0.03).all())
            exact += int((logp.argmax(-1) == torch.tensor(toks)).sum())
        return exact

    return check


def hf_logprobs(model_dir: Path, view: View, ids: list[int], toks: list[int]) -> np.ndarray:
    """Hugging Face's teacher-forced logprobs of ``toks`` after ``ids`` on ``view``'s weights
    (a tied head is the embedding, published once under its name: only ``lm_head.weight`` may
    be missing from the view)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    sd = {
        n: torch.from_numpy(t.data.view(np.int16).copy()).view(torch.bfloat16).reshape(t.shape)
        for n, t in view.items()
    }
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if missing:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([ids + toks])).logits[0].float()
    logp = torch.log_softmax(logits[len(ids) - 1 : -1], -1)
    return logp[torch.arange(len(toks)), torch.tensor(toks)].numpy()
