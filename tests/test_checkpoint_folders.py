"""Checkpoint folders (rollpatch.io.checkpoint): a Hugging Face model directory is read as its
index names it, checked both ways, and refused clearly when its index or shards disagree;
``rollpatch publish`` and ``rollpatch cast`` take such a folder and publish what its single
file would have published."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from rollpatch.board import Board
from rollpatch.cli import main
from rollpatch.errors import ConfigError, ViewError
from rollpatch.io import load_view
from rollpatch.io.checkpoint import checkpoint_files, load_masters

INDEX = "model.safetensors.index.json"


def _masters() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        f"model.layers.{i}.{w}.weight": rng.standard_normal((16, 8)).astype(np.float32)
        for i in range(3)
        for w in ("q", "k")
    }


def _sharded(folder: Path, masters: dict[str, np.ndarray], parts: int = 2) -> dict[str, str]:
    """``masters`` saved as ``parts`` shards with an index, as ``save_pretrained`` does."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(masters)
    wm = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        held = names[i::parts]
        save_file({k: masters[k] for k in held}, str(folder / file))
        wm.update({k: file for k in held})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    (folder / "config.json").write_text("{}")
    return wm


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert np.array_equal(v, b[k]), k


def test_a_sharded_folder_reads_as_its_index_names_it(tmp_path: Path) -> None:
    masters = _masters()
    _sharded(tmp_path / "m", masters)
    save_file({"stray": np.zeros(3, np.float32)}, str(tmp_path / "m" / "adapter.safetensors"))
    files, index = checkpoint_files(tmp_path / "m")
    assert [f.name for f in files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert index is not None and len(index) == len(masters)
    _same(load_masters(tmp_path / "m"), masters)  # the stray file the index does not name: unread


def test_folders_without_an_index(tmp_path: Path) -> None:
    masters = _masters()
    single = tmp_path / "single"
    single.mkdir()
    save_file(masters, str(single / "model.safetensors"))
    _same(load_masters(single), masters)
    noindex = tmp_path / "noindex"
    _sharded(noindex, masters, parts=3)
    (noindex / INDEX).unlink()
    _same(load_masters(noindex), masters)  # every *.safetensors, none twice


def test_torch_folders_leave_a_trainers_state_alone(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    masters = _masters()
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save({k: torch.from_numpy(v) for k, v in masters.items()}, d / "pytorch_model.bin")
    (d / "optimizer.pt").write_bytes(b"\x80\x05not read")
    (d / "training_args.bin").write_bytes(b"\x80\x05not read")
    (d / "rng_state.pth").write_bytes(b"\x80\x05not read")
    files, index = checkpoint_files(d)
    assert [f.name for f in files] == ["pytorch_model.bin"] and index is None
    _same(load_masters(d), masters)


@pytest.mark.parametrize(
    "break_it, match",
    [
        ("wrong_shard", "does not map this tensor to the shard holding it"),
        ("missing_tensor", "names 1 tensor its shards do not hold"),
        ("outside", "other than a file beside it"),
        ("missing_shard", "a shard the index names is missing"),
        ("no_map", "has no weight_map"),
        ("not_json", "is not JSON"),
    ],
)
def test_an_index_that_disagrees_is_refused(tmp_path: Path, break_it: str, match: str) -> None:
    d = tmp_path / "m"
    wm = _sharded(d, _masters())
    first = min(wm)
    doc: object = {"weight_map": wm}
    if break_it == "wrong_shard":
        wm[first] = next(f for f in set(wm.values()) if f != wm[first])
    elif break_it == "missing_tensor":
        wm["model.extra.weight"] = wm[first]
    elif break_it == "outside":
        (tmp_path / "evil.safetensors").write_bytes(b"")
        wm[first] = "../evil.safetensors"
    elif break_it == "missing_shard":
        wm[first] = "model-00009-of-00009.safetensors"
    elif break_it == "no_map":
        doc = {"metadata": {}}
    (d / INDEX).write_text("{not json" if break_it == "not_json" else json.dumps(doc))
    with pytest.raises(ViewError, match=match):
        load_masters(d)


def test_an_oversized_index_is_refused_before_it_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpatch.io import checkpoint

    d = tmp_path / "m"
    _sharded(d, _masters())
    monkeypatch.setattr(checkpoint, "MAX_INDEX_BYTES", 64)
    with pytest.raises(ViewError, match="index too large"):
        load_masters(d)


def test_an_empty_folder_says_what_it_wants(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no weights") as e:
        load_masters(tmp_path)
    assert "model.safetensors.index.json" in (e.value.hint or "")


def test_publish_and_cast_take_a_model_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    masters = _masters()
    _sharded(tmp_path / "m", masters)
    file = tmp_path / "one.safetensors"
    save_file(masters, str(file))
    for src, out in ((tmp_path / "m", "a.safetensors"), (file, "b.safetensors")):
        assert main(["cast", str(src), "-o", str(tmp_path / out)]) == 0
    assert (
        load_view(tmp_path / "a.safetensors").digest()
        == load_view(tmp_path / "b.safetensors").digest()
    )
    boards = []
    for i, src in enumerate((tmp_path / "m", file)):
        board = f"file://{tmp_path / f'board{i}'}"
        assert main(["publish", str(src), "--board", board, "--run", "r1"]) == 0
        boards.append(Board(board).manifest("r1", 0).target)
    assert boards[0] == boards[1]
    capsys.readouterr()


def test_a_shard_left_out_of_the_index_is_refused(tmp_path: Path) -> None:
    """A tensor deleted from the index whose shard held only it: that shard is not named,
    and would be skipped with the tensor; refused instead."""
    d = tmp_path / "m"
    masters = _masters()
    wm = _sharded(d, masters, parts=3)
    held = {f: [k for k, v in wm.items() if v == f] for f in set(wm.values())}
    lone = max(held)
    for k in held[lone]:
        del wm[k]
    (d / INDEX).write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ViewError, match="holds a shard its index does not name") as e:
        load_masters(d)
    assert lone in str(e.value)


def test_a_model_file_beside_an_adapter_or_a_trainers_state(tmp_path: Path) -> None:
    """model.safetensors alone is the model: a PEFT adapter beside it is not merged in; a
    torch trainer folder's scaler.pt (fp16 AMP) is a trainer's state, not read."""
    masters = _masters()
    d = tmp_path / "peft"
    d.mkdir()
    save_file(masters, str(d / "model.safetensors"))
    save_file({"lora_A": np.zeros((2, 8), np.float32)}, str(d / "adapter_model.safetensors"))
    _same(load_masters(d), masters)
    shards = tmp_path / "shards"
    _sharded(shards, masters)
    (shards / INDEX).unlink()
    save_file({"lora_A": np.zeros((2, 8), np.float32)}, str(shards / "adapter_model.safetensors"))
    _same(load_masters(shards), masters)
    torch = pytest.importorskip("torch")
    t = tmp_path / "trainer"
    t.mkdir()
    half = dict(sorted(masters.items())[:3])
    torch.save({k: torch.from_numpy(v) for k, v in half.items()}, t / "model.pt")
    (t / "scaler.pt").write_bytes(b"\x80\x05not read")
    _same(load_masters(t), half)


def test_a_trainers_output_folder_names_its_checkpoints(tmp_path: Path) -> None:
    for step in (10, 20):
        (tmp_path / f"checkpoint-{step}").mkdir()
    with pytest.raises(ConfigError, match="holds no weights") as e:
        load_masters(tmp_path)
    assert "checkpoint-10, checkpoint-20" in (e.value.hint or "")
