"""The reference engine: the tiny model, the view over its parameters' memory, patches and
keyframes applied in place. Its OpenAI server: test_reference_engine_server.py; generation,
pause and commit mid-generation: test_reference_engine_generation.py; staged commits,
double buffers and the audit: test_reference_engine_staged.py (fixtures: tests/refenginefix.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from rollpatch.errors import BaseMismatchError, EngineError, TargetMismatchError
from rollpatch.patch import Patch, diff
from rollpatch.view import Tensor, View
from tests.refenginefix import PROMPT, base, engine, greedy, model_dir, restore, target, target_dir

_FIXTURES = (base, engine, model_dir, restore, target, target_dir)  # used by name


# ---- model maker and memory -------------------------------------------------------------


def test_make_tiny_model_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from rollpatch.engines.reference import make_tiny_model

    cfg = AutoConfig.from_pretrained(model_dir)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (2048, 128, 2)
    assert cfg.tie_word_embeddings is False
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == cfg.vocab_size
    assert tok.decode(tok.encode(PROMPT)) == PROMPT
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(chat, str) and chat.endswith("<|assistant|>\n")
    again = make_tiny_model(tmp_path / "again")
    weights = (again / "model.safetensors").read_bytes()
    assert weights == (model_dir / "model.safetensors").read_bytes()
    other = make_tiny_model(tmp_path / "other", seed=1, layers=1)
    assert (other / "model.safetensors").read_bytes() != weights


def test_importing_rollpatch_does_not_import_torch() -> None:
    code = (
        "import sys, rollpatch, rollpatch.engines, rollpatch.engines.reference as r; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
        "assert 'make_tiny_model' in r.__all__"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_view_shares_memory_with_parameters(engine: Any, model_dir: Path) -> None:
    from rollpatch.io.safetensors import load_view

    rt = engine.runtime
    params = rt.model.state_dict(keep_vars=True)
    on_disk = load_view(model_dir / "model.safetensors")
    assert set(rt.view) == set(on_disk) == set(params)  # checkpoint names, no rotary buffers
    assert "lm_head.weight" in rt.view and "model.layers.0.self_attn.q_proj.weight" in rt.view
    for name, t in rt.view.items():
        assert t.kind.name == "bf16" and t.shape == tuple(params[name].shape)
        assert t.data.__array_interface__["data"][0] == params[name].data_ptr()  # no copy
    assert sum(t.nbytes for t in rt.view.values()) == sum(
        p.numel() * p.element_size() for p in params.values()
    )
    w, p = rt.view["lm_head.weight"].data, params["lm_head.weight"].detach().view(torch.int16)
    w[5] ^= 0x0100  # a write through the view is a write to the parameter
    assert int(p.reshape(-1)[5]) & 0xFFFF == int(w[5])
    w[5] ^= 0x0100
    rt.view.invalidate("lm_head.weight")
    assert rt.digest() == on_disk.digest()


# ---- patches in place ---------------------------------------------------------------------


def test_patch_in_place_equals_fresh_target_model(
    engine: Any, base: View, target: View, target_dir: Path, restore: None
) -> None:
    from rollpatch.engines.reference import ReferenceRuntime

    rt = engine.runtime
    fresh = ReferenceRuntime(target_dir, threads=1)
    assert fresh.digest() == target.digest()
    want = greedy(fresh)
    before = greedy(rt)
    assert [t for t, _, _ in before] != [t for t, _, _ in want]  # the change is visible
    ptrs = {n: p.data_ptr() for n, p in rt.model.state_dict(keep_vars=True).items()}
    patch = diff(base, target)
    assert 0 < patch.n_changed < 0.1 * sum(t.n_elements for t in base.values())
    engine.apply(patch, 2)
    assert engine.version == 2 and engine.digest == target.digest()
    assert greedy(rt) == want  # token ids and logprobs, bit for bit
    assert {n: p.data_ptr() for n, p in rt.model.state_dict(keep_vars=True).items()} == ptrs
    engine.apply(patch.inverse(), 1)
    assert engine.digest == base.digest() and greedy(rt) == before


def test_failed_patches_leave_weights_untouched(engine: Any, base: View, target: View) -> None:
    rt = engine.runtime
    words = {n: t.data.copy() for n, t in rt.view.items()}
    wrong = diff(target, base)  # its base is version 2; the engine holds version 1
    with pytest.raises(BaseMismatchError):
        engine.apply(wrong, 3)
    good = diff(base, target)
    bad = Patch(good.base, "00" * 32, good.tensors)  # right base, wrong target
    with pytest.raises(TargetMismatchError):
        engine.apply(bad, 3)
    assert engine.version == 1
    assert all(np.array_equal(words[n], t.data) for n, t in rt.view.items())
    rt.view.invalidate()
    assert rt.digest() == base.digest()


def test_load_keyframe_checks_layout(engine: Any, base: View, target: View, restore: None) -> None:
    engine.load(target, 5)
    assert engine.version == 5 and engine.digest == target.digest()
    bad, missing = target.copy(), target.copy()
    lm = base["lm_head.weight"]
    bad["lm_head.weight"] = Tensor(lm.kind, (1024, 256), lm.data)
    del missing["lm_head.weight"]
    for view in (bad, missing):
        with pytest.raises(EngineError):
            engine.load(view, 6)
    assert engine.version == 5 and engine.digest == target.digest()
