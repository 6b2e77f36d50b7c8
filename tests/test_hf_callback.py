"""RollpatchCallback: a transformers Trainer (and a TRL SFTTrainer) on the CPU publishes one
version per optimizer step to a file:// board, and the board's LATEST is the model's view."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' Trainer needs it

from torch.utils.data import Dataset

from rollpatch.board import Board
from rollpatch.errors import ConfigError
from rollpatch.formats import cast_view
from rollpatch.publisher import Publisher, PublisherConfig, reconstruct, snapshot_state
from rollpatch.publisher.hf import RollpatchCallback, float_state_dict
from tests.conftest import hf_tiny_llama

RUN = "hf-run"


class _Tokens(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 96, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: Path, steps: int, **extra: Any) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )


def _served(model: Any) -> str:
    return cast_view(snapshot_state(float_state_dict(model)), "bf16").digest()


def test_trainer_publishes_one_version_per_optimizer_step(tmp_path: Path) -> None:
    board = f"file://{tmp_path / 'board'}"
    pub = Publisher(
        board, RUN, PublisherConfig(format="bf16", keyframe_every=0), asynchronous=False
    )
    cb = RollpatchCallback(pub)
    model = hf_tiny_llama()
    # Two micro-batches per optimizer step: a version is a parameter update, not a micro-batch.
    trainer = transformers.Trainer(
        model=model,
        args=_args(tmp_path / "out", 3, gradient_accumulation_steps=2),
        train_dataset=_Tokens(16),
        callbacks=[cb],
    )
    trainer.train()
    b = Board(board)
    assert b.versions(RUN) == [0, 1, 2]
    assert [b.manifest(RUN, n).meta["step"] for n in range(3)] == ["1", "2", "3"]
    latest = b.latest(RUN)
    assert latest is not None and latest.version == 2
    assert (cb.last_version, cb.n_published) == (2, 3)
    assert reconstruct(board, RUN).digest() == _served(model)
    with pytest.raises(ConfigError):  # closed at train end
        pub.publish(float_state_dict(model))


def test_the_final_weights_are_published_when_the_last_step_is_not_due(tmp_path: Path) -> None:
    """every=2 over 5 steps: versions at steps 2 and 4, and the final weights (step 5) at the
    end of training; they were left unpublished."""
    board = f"file://{tmp_path / 'board'}"
    pub = Publisher(board, RUN, PublisherConfig(format="bf16"), asynchronous=False)
    cb = RollpatchCallback(pub, every=2)
    model = hf_tiny_llama()
    trainer = transformers.Trainer(
        model=model, args=_args(tmp_path / "out", 5), train_dataset=_Tokens(16), callbacks=[cb]
    )
    trainer.train()
    b = Board(board)
    assert [b.manifest(RUN, n).meta["step"] for n in b.versions(RUN)] == ["2", "4", "5"]
    assert reconstruct(board, RUN).digest() == _served(model)


def test_only_the_main_process_publishes_with_an_unsharded_publisher(tmp_path: Path) -> None:
    pub = Publisher(f"file://{tmp_path / 'board'}", RUN, asynchronous=False)
    cb = RollpatchCallback(pub, every=2)
    model = hf_tiny_llama()
    other_rank = SimpleNamespace(is_world_process_zero=False, global_step=2)
    cb.on_step_end(None, other_rank, None, model=model)
    main_rank = SimpleNamespace(is_world_process_zero=True, global_step=1)
    cb.on_step_end(None, main_rank, None, model=model)  # not a multiple of `every`
    assert cb.n_published == 0
    main_rank.global_step = 2
    cb.on_step_end(None, main_rank, None, model=model)
    assert (cb.n_published, cb.last_version) == (1, 0)
    RollpatchCallback(None).on_step_end(None, main_rank, None, model=model)  # ranks without one
    pub.close()


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_callback_validates_every(tmp_path: Path, every: Any) -> None:
    with pytest.raises(ConfigError, match="every"):
        RollpatchCallback(None, every=every)


def test_callback_refuses_what_is_not_a_publisher() -> None:
    with pytest.raises(ConfigError, match="Publisher"):
        RollpatchCallback("file:///tmp/board")  # type: ignore[arg-type]


def test_import_rollpatch_does_not_import_transformers() -> None:
    code = (
        "import sys, rollpatch, rollpatch.publisher, rollpatch.cli; "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_trl_sft_trainer_publishes_every_step(tmp_path: Path) -> None:
    import datasets
    import trl  # a dev dependency: the test fails, never skips, without it

    from rollpatch.engines.reference import make_tokenizer

    tok_dir = make_tokenizer(tmp_path / "tok", vocab_size=384, seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    model = hf_tiny_llama(
        len(tokenizer),
        128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = [f"the answer to {a} plus {b} is {a + b}" for a in range(4) for b in range(3)]
    board = f"file://{tmp_path / 'board'}"
    pub = Publisher(board, RUN, PublisherConfig(format="bf16", keyframe_every=0))
    cb = RollpatchCallback(pub, publish_initial=True, flush_every_step=True)
    sft = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_length=64,
        seed=0,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=sft,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        callbacks=[cb],
    )
    trainer.train()
    b = Board(board)
    assert b.versions(RUN) == [0, 1, 2, 3]  # the initial weights, then one per step
    assert b.manifest(RUN, 0).meta["step"] == "0"
    assert reconstruct(board, RUN).digest() == _served(trainer.model)
    assert reconstruct(board, RUN, 0).digest() != reconstruct(board, RUN, 3).digest()
