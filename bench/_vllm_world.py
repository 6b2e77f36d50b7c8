"""bench/vllm.py's run: a model, FP32 masters under AdamW, a board, one checkpoint a version
(step patches; with ``fold_every`` also a folded patch from the last multiple of it)."""

from __future__ import annotations

import argparse
import gc
import shutil
from pathlib import Path

import numpy as np
from _util import WarmAdamW
from _vllm_server import BenchError

from rollpatch.board import Board
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig

RUN = "bench"
VOCAB = 4096


def add_world_args(ap: argparse.ArgumentParser, *, versions: int, hidden: int, layers: int) -> None:
    """The engine benches' model and versions: ``--versions --lr --hidden --layers``."""
    ap.add_argument(
        "--versions", type=int, default=versions, help=f"versions after v0 (default {versions})"
    )
    ap.add_argument("--lr", type=float, default=5e-6, help="AdamW learning rate")
    ap.add_argument("--hidden", type=int, default=hidden, help=f"model width (default {hidden})")
    ap.add_argument("--layers", type=int, default=layers, help=f"model depth (default {layers})")


def model_dims(hidden: int, layers: int) -> dict[str, int]:
    """Llama-shaped: 64-wide heads, half as many KV heads, ff ≈ 2.75 x hidden (multiple of 64)."""
    heads = max(1, hidden // 64)
    return {
        "hidden_size": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": max(1, heads // 2),
        "intermediate": 64 * round(2.75 * hidden / 64),
        "vocab_size": VOCAB,
    }


class World:
    """The model, FP32 masters with warm AdamW state, the board, one checkpoint per version."""

    def __init__(
        self, root: Path, lr: float, versions: int, dims: dict[str, int], fold_every: int = 0
    ) -> None:
        from transformers.utils import logging as hf_logging

        from rollpatch.engines.reference import make_tiny_model
        from rollpatch.io.safetensors import load_view

        hf_logging.disable_progress_bar()
        self.root = root
        self.dims = dims
        self.model = make_tiny_model(root / "model", seed=0, **dims)
        self.masters = {
            n: t.to_array().astype(np.float32)
            for n, t in load_view(self.model / "model.safetensors").items()
        }
        self.board = f"file://{root / 'board'}"
        self.publisher = Publisher(
            self.board,
            RUN,
            PublisherConfig(keyframe_every=0, skip_strides=(), fold_every=fold_every),
            asynchronous=False,
        )
        self.fold_every = fold_every
        self.adam = WarmAdamW(self.masters, lr)
        self.digests: list[str] = []
        self.changed: list[float] = [0.0]
        self.patch_bytes: list[int] = [0]
        self.ckpt_bytes: list[int] = []
        self.view = cast_view(self.masters, "bf16")
        self.params = sum(t.n_elements for t in self.view.values())
        self._publish()
        for _ in range(versions):
            self.step()
        # the runs need only the board, the checkpoints and the digests: give the FP32
        # masters, the Adam state and the views back before any engine starts (at 400M+ they
        # are several GB)
        self.publisher.close()
        del self.masters, self.adam, self.view, self.publisher
        gc.collect()

    def step(self) -> None:
        """One AdamW step of every master, then publish it."""
        self.adam.step()
        before, self.view = self.view, cast_view(self.masters, "bf16")
        changed = sum(int(np.count_nonzero(before[k].data != t.data)) for k, t in self.view.items())
        self.changed.append(changed / self.params)
        self._publish()

    def _publish(self) -> None:
        from rollpatch.io.safetensors import save_view

        v = self.publisher.publish(self.masters)
        if v != len(self.digests):
            raise BenchError(f"published v{v}, expected v{len(self.digests)}")
        self.digests.append(self.view.digest())
        m = Board(self.board).manifest(RUN, v)
        if m.target != self.digests[v]:
            raise BenchError(f"manifest target of v{v} is not cast_view(masters).digest()")
        if v:
            self.patch_bytes.append(sum(p.ref.size for p in m.patches_from(v - 1)))
        ckpt = self.checkpoint(v)
        ckpt.mkdir()
        for p in self.model.iterdir():
            if p.suffix != ".safetensors":
                shutil.copy(p, ckpt / p.name)
        save_view(self.view, ckpt / "model.safetensors")
        self.ckpt_bytes.append((ckpt / "model.safetensors").stat().st_size)

    def checkpoint(self, v: int) -> Path:
        return self.root / f"ckpt-{v:04d}"

    def warm(self, v: int) -> Path:
        """Version ``v``'s checkpoint directory, every file of it read once so that a reload
        timed next finds it in the page cache ("page-cached", as vLLM's and SGLang's reloads
        are compared); read in 16 MiB pieces into one buffer, not whole into memory."""
        ckpt, buf = self.checkpoint(v), bytearray(16 << 20)
        for p in ckpt.iterdir():
            with p.open("rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        return ckpt

    def patch_blob(self, v: int, base: int | None = None) -> bytes:
        """Version ``v``'s patch object from ``base`` (default: its parent; a folded patch
        from its anchor with ``fold_every``)."""
        board = Board(self.board)
        (po,) = board.manifest(RUN, v).patches_from(v - 1 if base is None else base)
        return board.fetch(po.ref)
