"""The typed vocabulary: tensor ops, protocol decisions and manifests are closed, typed sets.

mypy (``strict_equality``) rejects a misspelt op or action where it is built or compared;
these tests pin the runtime side: each op's payload is reached through a typed accessor that
refuses the wrong op, every decision the protocol makes is one of its declared actions, and
a manifest cannot be built by position.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import numpy as np
import pytest

import rollpatch
from rollpatch.errors import PatchError
from rollpatch.kinds import KINDS
from rollpatch.manifest import KeyframeObject, Manifest
from rollpatch.patch.model import OPS, DeltaOp, DropOp, FullOp, Op, TensorOp, TensorPatch
from rollpatch.protocol import ACTIONS, Action, Decision, decide
from rollpatch.types import Constraint, ObjectRef
from rollpatch.view import Tensor
from tests.conftest import DIGEST, make_manifest

BF16 = KINDS["bf16"]


def test_ops_are_the_literal_and_the_runtime_check() -> None:
    assert typing.get_args(TensorOp) == OPS == ("delta", "full", "drop")
    assert tuple(c.op for c in typing.get_args(Op)) == OPS == (DeltaOp.op, FullOp.op, DropOp.op)
    with pytest.raises(PatchError, match="unknown tensor op"):
        TensorPatch("t", BF16, (2,), None, None, "delta")  # type: ignore[arg-type]


def test_each_op_carries_exactly_its_payload() -> None:
    pos, old, new = np.array([1], np.int64), np.array([3], np.uint16), np.array([4], np.uint16)
    delta = TensorPatch("t", BF16, (2,), DIGEST, DIGEST, DeltaOp(pos, old, new))
    match delta.change:
        case DeltaOp(p, o, n):
            assert (p, o, n) == (pos, old, new) and delta.op == "delta"
        case _:
            pytest.fail("a delta's change is a DeltaOp")
    assert delta.changes() is delta.change
    with pytest.raises(PatchError, match="carries no tensor"):
        delta.full_tensor()
    with pytest.raises(PatchError, match="lengths differ"):
        TensorPatch("t", BF16, (2,), DIGEST, DIGEST, DeltaOp(pos, old, np.zeros(2, np.uint16)))
    t = Tensor(BF16, (2,), np.zeros(2, np.uint16))
    full = TensorPatch("t", BF16, (2,), None, DIGEST, FullOp(t))
    assert full.full_tensor() is t and full.n_changed == 2 and full.op == "full"
    with pytest.raises(PatchError, match="no changed positions"):
        full.changes()
    drop = TensorPatch("t", BF16, (2,), DIGEST, None, DropOp())
    assert drop.op == "drop" and drop.n_changed == 2
    for accessor in (drop.changes, drop.full_tensor):
        with pytest.raises(PatchError):
            accessor()


def test_no_consumer_narrows_an_op_payload_by_hand() -> None:
    """Ops are told apart by their class, so no module compares an op's name or asserts a
    payload field present (the wire reader spells the names; it parses header dicts)."""
    src = Path(rollpatch.__file__).parent
    narrowing = re.compile(
        r"\.(positions|old|new|tensor) is not None|\.op\s*(==|!=|in)\s*\(?[\"'](delta|full|drop)\b"
    )
    found = [
        f"{path.relative_to(src)}:{i}: {line.strip()}"
        for path in sorted(src.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if narrowing.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("served", [None, 0, 3, 5, 9])
@pytest.mark.parametrize("latest", [None, 5, 9])
@pytest.mark.parametrize(
    "c",
    [
        Constraint(),
        Constraint(min_version=5),
        Constraint(exact_version=5),
        Constraint(max_lag=1),
        Constraint(min_version=7),
    ],
)
def test_every_decision_is_a_declared_action(
    c: Constraint, served: int | None, latest: int | None
) -> None:
    d = decide(c, served, latest)
    assert isinstance(d, Decision) and d.action in ACTIONS
    assert typing.get_args(Action) == ACTIONS


def test_manifest_is_keyword_only() -> None:
    kf = (KeyframeObject(ObjectRef("runs/r1/objects/k", 1, DIGEST)),)
    with pytest.raises(TypeError):
        Manifest("r1", 0, None, "bf16", DIGEST, 1, 0.0, "t", (), kf)  # type: ignore[call-arg]
    m = make_manifest("r1", 0, keyframes=kf, created=0.0)
    assert Manifest.from_json(m.to_json()) == m
