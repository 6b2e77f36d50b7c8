"""Tensor names as they enter rollpatch (an audit, session 41): a name the safetensors format
reserves (``__metadata__``, H-F2) or one no patch can carry (0 or more than 1024 bytes of
UTF-8, H-F4; the served names in analyze too, N-3) is refused up front by cast, diff,
publish and analyze, naming the tensor and the rule; and the name a tied head is published under does not depend on the state dict's
key order (H-F3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollpatch.board import Board
from rollpatch.cli import EXIT_REFUSED, main
from rollpatch.errors import ViewError
from rollpatch.io import load_view, save_view, view_to_bytes
from rollpatch.io.names import MAX_NAME_BYTES, check_names
from rollpatch.publisher import Publisher, reconstruct
from rollpatch.publisher.guards import engine_names
from rollpatch.store import MemoryStore
from rollpatch.view import Tensor, View
from tests.conftest import masters, save_masters

torch = pytest.importorskip("torch")


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *said: str) -> str:
    assert main(argv) == EXIT_REFUSED
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("rollpatch: error: "), lines
    assert not any("Traceback" in ln for ln in lines)
    for s in said:
        assert s in lines[-1], lines[-1]
    return lines[-1]


def _pt(path: Path, names: list[str], step: float = 0.0) -> Path:
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(32, 32, generator=g) + step for n in names}
    torch.save(sd, path)
    return path


def test_a_tensor_named_metadata_is_refused_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _pt(tmp_path / "meta.pt", ["__metadata__", "w.weight"])
    out = tmp_path / "v.safetensors"
    said = ("'__metadata__'", "reserved by the safetensors format")
    _refused(capsys, ["cast", str(ckpt), "-o", str(out)], *said)
    assert not out.exists()
    other = _pt(tmp_path / "ok.pt", ["w.weight", "v.weight"])
    _refused(capsys, ["diff", str(other), str(ckpt), "-o", str(tmp_path / "p")], *said)
    board = tmp_path / "board"
    _refused(capsys, ["publish", "--board", str(board), "--run", "m", str(ckpt)], *said)
    assert not (board / "runs" / "m" / "LATEST").exists()
    _refused(capsys, ["analyze", str(other), str(ckpt), "--no-progress"], *said)
    # the writer itself never writes one (the metadata would be replaced)
    w = Tensor.from_array(np.zeros(4, np.float32))
    with pytest.raises(ViewError, match="reserved"):
        save_view(View({"__metadata__": w}), tmp_path / "x.safetensors")
    with pytest.raises(ViewError, match="reserved"):
        view_to_bytes(View({"__metadata__": w, "a": w}))
    assert not (tmp_path / "x.safetensors").exists()
    # the Python publisher too (its names: engine_names)
    with (
        pytest.raises(ViewError, match="reserved"),
        Publisher(Board(MemoryStore()), "m", asynchronous=False) as pub,
    ):
        pub.publish({"__metadata__": np.zeros((4, 4), np.float32)})


@pytest.mark.parametrize("name", ["", "x" * 1100 + ".weight", "é" * 513])
def test_names_no_patch_can_carry_are_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    a = _pt(tmp_path / "a.pt", [name, "w.weight"])
    b = _pt(tmp_path / "b.pt", [name, "w.weight"], step=1e-2)
    rule = f"1 to {MAX_NAME_BYTES} bytes of UTF-8"
    line = _refused(capsys, ["cast", str(a), "-o", str(tmp_path / "v")], rule, "a.pt")
    assert len(line) < 600  # a prefix of a long name, not all of it
    _refused(capsys, ["diff", str(a), str(b), "-o", str(tmp_path / "p")], rule)
    board = tmp_path / "board"
    _refused(capsys, ["publish", "--board", str(board), "--run", "l", str(a)], rule)
    assert not (tmp_path / "p").exists() and not (board / "runs" / "l" / "LATEST").exists()
    _refused(capsys, ["analyze", str(a), str(b), "--no-progress"], rule)  # N-3, session 41


def test_a_name_the_format_makes_too_long_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1020 bytes pass as a master, but nvfp4 serves ``NAME_global_scale``: refused."""
    m = masters(1)
    long = "m" * 1013 + ".weight"
    m[long] = m.pop("model.layers.0.mlp.up_proj.weight")
    ckpt = tmp_path / "m.safetensors"
    save_masters(ckpt, m)
    assert main(["cast", str(ckpt), "-o", str(tmp_path / "bf16.safetensors")]) == 0
    argv = ["cast", str(ckpt), "--format", "nvfp4", "-o", str(tmp_path / "v")]
    _refused(capsys, argv, "bytes of UTF-8", "_packed")
    board = str(tmp_path / "board")
    _refused(capsys, ["publish", "--board", board, "--run", "q", "--format", "nvfp4", str(ckpt)])
    # analyze too: it measures the served view (N-3, session 41: it measured this one)
    m[long] = m[long] + 1e-2
    save_masters(tmp_path / "m2.safetensors", m)
    argv = ["analyze", str(ckpt), str(tmp_path / "m2.safetensors"), "--format", "nvfp4"]
    _refused(capsys, [*argv, "--no-progress"], "bytes of UTF-8", "_packed")


def test_the_name_rule_is_the_patch_formats() -> None:
    from rollpatch.patch.header import MAX_NAME_BYTES as PATCH_MAX

    assert PATCH_MAX == MAX_NAME_BYTES
    check_names(["a", "é" * 512, "x" * MAX_NAME_BYTES])
    for bad in ("", "x" * (MAX_NAME_BYTES + 1), "\ud800", "__metadata__"):
        with pytest.raises(ViewError):
            check_names([bad])


def _tied(order: str) -> dict[str, object]:
    emb = torch.nn.Parameter(torch.randn(50, 16, generator=torch.Generator().manual_seed(1)))
    sd = {
        "model.embed_tokens.weight": emb,
        "model.norm.weight": torch.ones(16),
        "lm_head.weight": emb,
    }
    names = sorted(sd) if order == "sorted" else list(sd)
    return {n: sd[n].detach() for n in names}


def test_a_tied_head_is_published_under_the_embeddings_name_in_any_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain, ordered = _tied("as_built"), _tied("sorted")
    assert next(iter(ordered)) == "lm_head.weight"  # the order that used to keep the head
    for sd in (plain, ordered, dict(reversed(list(plain.items())))):
        out, _, dropped = engine_names(sd)
        assert "model.embed_tokens.weight" in out and dropped == ["lm_head.weight"]
    torch.save(plain, tmp_path / "tied.pt")
    torch.save(ordered, tmp_path / "sorted.pt")
    digests = []
    for f in ("tied.pt", "sorted.pt"):
        out = tmp_path / f"{f}.safetensors"
        assert main(["cast", str(tmp_path / f), "-o", str(out)]) == 0
        view = load_view(out)
        assert sorted(view) == ["model.embed_tokens.weight", "model.norm.weight"]
        digests.append(view.digest())
    assert digests[0] == digests[1]
    board = tmp_path / "board"
    for f in ("sorted.pt", "tied.pt"):  # the same model: the second is not "another model"
        assert main(["publish", "--board", str(board), "--run", "t", str(tmp_path / f)]) == 0
    b = Board(f"file://{board}")
    assert sorted(reconstruct(b, "t", 1)) == ["model.embed_tokens.weight", "model.norm.weight"]
    # other common tied heads (GPT-NeoX, Meta's checkpoints): the embedding too
    e = torch.zeros(4, 4)
    for head, embed in (
        ("embed_out.weight", "gpt_neox.embed_in.weight"),
        ("output.weight", "tok_embeddings.weight"),
    ):
        for sd in ({head: e, embed: e}, {embed: e, head: e}):
            assert list(engine_names(sd)[0]) == [embed]


@pytest.mark.parametrize(
    "names",
    [
        # T5 v1.0: shared, both embed_tokens and the head are one storage
        [
            "shared.weight",
            "encoder.embed_tokens.weight",
            "decoder.embed_tokens.weight",
            "lm_head.weight",
        ],
        # BART, mBART, Pegasus
        [
            "model.shared.weight",
            "model.encoder.embed_tokens.weight",
            "model.decoder.embed_tokens.weight",
            "lm_head.weight",
        ],
    ],
)
def test_an_embedding_tied_three_or_four_ways_is_published_as_the_shared_one(
    names: list[str],
) -> None:
    """The name ``save_pretrained`` keeps for an encoder-decoder's shared embedding (N-5,
    session 41: the smallest name, ``decoder.embed_tokens.weight``, was published)."""
    e = torch.zeros(8, 4)
    for order in (names, sorted(names), list(reversed(names))):
        sd = {n: e for n in order} | {"final_layer_norm.weight": torch.ones(4)}
        out, _, dropped = engine_names(sd)
        assert sorted(out) == sorted([names[0], "final_layer_norm.weight"])
        assert sorted(dropped) == sorted(names[1:])
